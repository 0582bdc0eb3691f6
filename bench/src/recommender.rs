//! Scenario 7: the recommender as deployed — `shelfsync_recommender::App`, bootstrapped from the
//! latest keyframe — queried in-process through the read path both APIs share (`Api::top`),
//! idle and while the live load updates its index, and over HTTP by a keep-alive load loop
//! (and by `wrk` when it is installed).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use shelfsync_cli::genfeed::CATEGORIES;
use shelfsync_recommender::{Api, App, Limits, PlaceKey, TopQuery};
use shelfsync_service::Service;
use tokio::sync::oneshot;

use crate::children::Target;
use crate::load::Load;
use crate::report::{HttpRun, RecommenderRun, Report};
use crate::stats::Percentiles;
use crate::world::{BRAND, World, free_port};

pub async fn run(world: &World, storage: &Target, report: &mut Report) -> anyhow::Result<()> {
    let p = &world.profile;
    let mut settings = storage.settings.clone();
    settings.recommender.http_listen = format!("127.0.0.1:{}", free_port()?);
    let app = App::build(settings).await?;
    let addr = app.http_addr();
    let (index, status) = (app.index(), app.status());
    let (stop, stopped) = oneshot::channel::<()>();
    let started = Instant::now();
    let task = tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    while !status.bootstrapped.load(std::sync::atomic::Ordering::SeqCst) {
        if task.is_finished() || started.elapsed() > Duration::from_secs(600) {
            bail!("the recommender did not bootstrap");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let bootstrap_s = started.elapsed().as_secs_f64();
    let offers = index.read().len() as u64;
    eprintln!("[bench] recommender bootstrapped in {bootstrap_s:.1} s: {offers} offers");

    let api = Api::new(index, status, Limits { default_top_n: 10, max_top_n: 100 });
    let queries = queries(p.places, p.queries);
    let _warm = time_queries(&api, &queries[..queries.len().min(10_000)]);
    let idle = time_queries(&api, &queries);
    eprintln!("[bench] top-10 in-process: {}", idle.render());
    let load = Load::start(world, storage, p.fresh_rate, 3);
    let live = time_queries(&api, &queries);
    load.stop().await?;
    eprintln!("[bench] top-10 in-process under live load: {}", live.render());

    let paths: Arc<Vec<String>> = Arc::new(
        queries
            .iter()
            .take(10_000)
            .map(|q| match &q.category {
                Some(c) => format!("/v1/top/{BRAND}/{}?category={c}&limit=10", q.place.place_id),
                None => format!("/v1/top/{BRAND}/{}?limit=10", q.place.place_id),
            })
            .collect(),
    );
    let mut http = Vec::new();
    let result = crate::http::load(addr, paths.clone(), p.http_connections, p.http_run).await?;
    let latency = Percentiles::of(result.latencies_ms, "ms");
    let rps = result.requests as f64 / result.elapsed.as_secs_f64();
    eprintln!(
        "[bench] HTTP (built-in, {} connections): {rps:.0} req/s, {}",
        p.http_connections,
        latency.render()
    );
    http.push(HttpRun {
        tool: "built-in keep-alive loop (same process as the server)".into(),
        connections: p.http_connections,
        seconds: result.elapsed.as_secs_f64(),
        requests: result.requests,
        errors: result.errors,
        requests_per_s: rps,
        latency: Some(latency),
    });
    if let Some(run) = wrk(addr, &paths[0], p.http_connections, p.http_run).await {
        eprintln!("[bench] HTTP (wrk): {:.0} req/s", run.requests_per_s);
        http.push(run);
    }
    report.recommender =
        Some(RecommenderRun { offers, bootstrap_s, query_idle: idle, query_live: live, http });
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
    Ok(())
}

/// Random places, half with a random category, top 10.
fn queries(places: u32, n: usize) -> Vec<TopQuery> {
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|i| TopQuery {
            place: PlaceKey::new(BRAND, 1 + (next() % u64::from(places)) as i64),
            category: (i % 2 == 0)
                .then(|| CATEGORIES[(next() % CATEGORIES.len() as u64) as usize].to_string()),
            limit: 10,
            exclude: Vec::new(),
        })
        .collect()
}

/// Latency of each query through `Api::top` (read lock + query), µs.
fn time_queries(api: &Api, queries: &[TopQuery]) -> Percentiles {
    let mut samples = Vec::with_capacity(queries.len());
    for q in queries {
        let started = Instant::now();
        let answer = api.top(q);
        samples.push(started.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(answer.ok());
    }
    Percentiles::of(samples, "µs")
}

/// `wrk` on one URL, if installed: requests/s from its summary.
async fn wrk(
    addr: std::net::SocketAddr,
    path: &str,
    connections: usize,
    run: Duration,
) -> Option<HttpRun> {
    let out = tokio::process::Command::new("wrk")
        .args(["-t2", &format!("-c{connections}"), &format!("-d{}s", run.as_secs().max(1))])
        .arg(format!("http://{addr}{path}"))
        .output()
        .await
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rps: f64 =
        text.lines().find_map(|l| l.strip_prefix("Requests/sec:"))?.trim().parse().ok()?;
    let requests = text
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    Some(HttpRun {
        tool: "wrk -t2 (one URL)".into(),
        connections,
        seconds: run.as_secs_f64(),
        requests,
        errors: 0,
        requests_per_s: rps,
        latency: None,
    })
}
