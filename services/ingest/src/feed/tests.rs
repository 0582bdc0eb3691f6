//! The parser on small feeds: both layouts, every rejection, the hard cap,
//! `places` before `brand_id`, and bounded memory.

use std::cell::Cell;

use super::ndjson::read_line_bounded;
use super::*;
use crate::item::OwnedFields;

const RULES: ItemRules = ItemRules { brand_id: 7, owned: OwnedFields::ALL, max_item_bytes: 1024 };

/// Runs a feed; events as one string: `P42` place, `I42/a` item,
/// `R42/a:reason` rejection (`-` where unknown).
fn run_as(input: &str, format: FeedFormat) -> (String, Result<Layout, FeedError>) {
    run_reader(input.as_bytes(), format)
}

fn run_reader(input: impl Read, format: FeedFormat) -> (String, Result<Layout, FeedError>) {
    let mut events = Vec::new();
    let result = parse_feed(input, format, &RULES, &mut |e| {
        events.push(match e {
            FeedEvent::Place(p) => format!("P{p}"),
            FeedEvent::Item(i) => format!("I{}/{}", i.place_id, i.id),
            FeedEvent::Reject(r) => {
                let place = r.place_id.map_or("-".into(), |p| p.to_string());
                format!("R{place}/{}:{}", r.id.as_deref().unwrap_or("-"), r.reason.as_str())
            }
        });
        Ok(())
    });
    (events.join(" "), result)
}

fn run(input: &str) -> (String, Result<Layout, FeedError>) {
    run_as(input, FeedFormat::Auto)
}

fn malformed(result: Result<Layout, FeedError>, needle: &str) {
    assert!(matches!(&result, Err(FeedError::Malformed(m)) if m.contains(needle)), "{result:?}");
}

#[test]
fn nested_and_ndjson_feeds_stream_places_and_items() {
    let nested = r#"{"brand_id": 7, "generated": "today", "places": [
          {"place_id": 42, "name": "x", "items": [{"id": "a", "price": 0}, {"id": "b"}]},
          {"place_id": 43, "items": []},
          {"place_id": 44}]}"#;
    let (events, result) = run(nested);
    assert_eq!(result.expect("parses"), Layout::Nested);
    assert_eq!(events, "P42 I42/a I42/b P43 P44", "places without items are seen");
    let ndjson = "{\"id\":\"a\",\"brand_id\":7,\"place_id\":1}\r\n\n\
                  {\"id\":\"b\",\"place_id\":2}\n{\"id\":\"c\",\"place_id\":1}";
    let (events, result) = run(ndjson);
    assert_eq!(result.expect("parses"), Layout::Ndjson);
    assert_eq!(events, "P1 I1/a P2 I2/b I1/c");
}

#[test]
fn auto_detection_and_explicit_formats() {
    let one_line = r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a"}]}]}"#;
    assert_eq!(run(one_line).1.expect("nested"), Layout::Nested);
    let pretty = "{\n  \"brand_id\": 7,\n  \"places\": []\n}\n";
    assert_eq!(run(pretty).1.expect("nested"), Layout::Nested);
    let ndjson = "\u{feff}  {\"id\":\"a\",\"place_id\":1}\n{\"id\":\"b\",\"place_id\":1}";
    assert_eq!(run(ndjson).1.expect("ndjson"), Layout::Ndjson);
    // A forced format wins over detection (an item is no feed object).
    malformed(run_as(ndjson, FeedFormat::Json).1, "no top-level `brand_id`");
    let (events, forced) = run_as(one_line, FeedFormat::Ndjson);
    assert_eq!((events.as_str(), forced.expect("ndjson")), ("R-/-:missing_place", Layout::Ndjson));
}

#[test]
fn keys_may_come_in_any_order() {
    let feed = r#"{"places": [
        {"items": [{"id": "a"}, {"id": "b", "price": "x"}], "place_id": 5},
        {"items": [{"id": "c"}]}
    ], "brand_id": 7}"#;
    let (events, result) = run(feed);
    result.expect("parses");
    assert_eq!(events, "P5 I5/a R5/b:wrong_type R-/-:missing_place");
}

#[test]
fn a_bad_item_is_rejected_alone() {
    let deep = format!("{}1{}", "[".repeat(500), "]".repeat(500));
    let feed = format!(
        r#"{{"brand_id":7,"places":[{{"place_id":1,"items":[
          {{"title":"no id"}}, 17, {{"id":"a","extra":{deep}}}, {{"id":"b","title":{deep}}},
          {{"id":"a","price":5}}, {{"id":"big","description":"{}"}}, {{"id":"c","price":1.5}},
          {{"id":"d","price":123456789012345678901}}, {{"id":"e","stock":null}}]}}]}}"#,
        "x".repeat(2000)
    );
    let (events, result) = run(&feed);
    result.expect("one bad item does not fail the feed");
    let expected = "P1 R1/-:missing_id R1/-:not_an_object I1/a R1/b:wrong_type R1/a:duplicate_id \
                    R1/-:too_large R1/c:wrong_type R1/d:out_of_range I1/e";
    assert_eq!(events, expected);

    let lines = [
        r#"{"id":"a","brand_id":7,"place_id":1}"#,
        r#"{"id":"b","brand_id":8,"place_id":1}"#,
        r#"{"id":"c","brand_id":7}"#,
        r#"{"id":"a","brand_id":7,"place_id":1}"#,
        r#"{"id":"d","place_id":1,"price": garbage}"#,
        &format!(r#"{{"id":"e","place_id":1,"title":"{}"}}"#, "t".repeat(5000)),
        r#"{"id":"f","place_id":2,"price":"1"}"#,
    ];
    let (events, result) = run(&lines.join("\n"));
    assert_eq!(result.expect("lines are independent"), Layout::Ndjson);
    let expected = "P1 I1/a R-/b:brand_mismatch R-/c:missing_place R1/a:duplicate_id R-/-:malformed \
                    R-/-:too_large P2 R2/f:wrong_type";
    assert_eq!(events, expected);
    let mut details = Vec::new();
    parse_feed(lines.join("\n").as_bytes(), FeedFormat::Auto, &RULES, &mut |e| {
        if let FeedEvent::Reject(r) = e {
            details.push(r.detail);
        }
        Ok(())
    })
    .expect("parses");
    assert!(details[3].starts_with("line 5: not JSON"), "{}", details[3]);
}

#[test]
fn not_json_fails_clearly() {
    let (events, result) = run("\n  <html><body>Bad gateway</body></html>");
    assert!(events.is_empty());
    let err = result.expect_err("not JSON");
    let msg = err.to_string();
    assert!(matches!(err, FeedError::NotJson { offset: 3, .. }), "{err:?}");
    assert!(msg.contains("not JSON") && msg.contains("byte 3") && msg.contains("<html>"), "{msg}");
    assert!(matches!(run(" \n ").1, Err(FeedError::Empty)));
    assert!(matches!(run("[1, 2]").1, Err(FeedError::NotJson { .. })));
}

#[test]
fn a_broken_document_fails_after_what_came_before() {
    let (events, result) =
        run(r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a"},{"id":"b"#);
    assert_eq!(events, "P1 I1/a", "a truncated feed is not a short feed");
    malformed(result, "EOF while parsing");
    // Garbage inside an item of the nested format cannot be skipped over.
    malformed(
        run(r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":1x}]}]}"#).1,
        "line 1 column",
    );
    malformed(run(r#"{"brand_id":"7","places":[]}"#).1, "`brand_id` must be an integer");
    let result = run(r#"{"places":[],"brand_id":8}"#).1;
    assert!(
        matches!(result, Err(FeedError::BrandMismatch { expected: 7, found: 8 })),
        "{result:?}"
    );
    // An item too big to hold fails the parse before it is in memory.
    let huge = format!(
        r#"{{"brand_id":7,"places":[{{"place_id":1,"items":[{{"id":"a"}},{{"id":"b","x":"{}"}}]}}]}}"#,
        "x".repeat(3 << 20)
    );
    let (events, result) = run(&huge);
    assert_eq!(events, "P1 I1/a");
    malformed(result, "hard cap");
}

/// A reader that hands out one byte per call: every state of the
/// top-level scan meets a buffer boundary.
struct Trickle<R>(R);

impl<R: Read> Read for Trickle<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(1);
        self.0.read(&mut buf[..n])
    }
}

/// A reader that hands out a few bytes per call, a different count each
/// time: items end up whole in one read, or split anywhere.
struct Chunks<R>(R, usize);

impl<R: Read> Read for Chunks<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.1 = (self.1 + 29) % 97;
        let n = buf.len().min(self.1 + 1);
        self.0.read(&mut buf[..n])
    }
}

/// Runs `input` whole and one byte at a time; both must agree.
fn run_both(input: &str) -> (String, Result<Layout, FeedError>) {
    let (events, result) = run(input);
    let (trickled, trickle_result) = run_reader(Trickle(input.as_bytes()), FeedFormat::Auto);
    assert_eq!(events, trickled, "{input}");
    assert_eq!(format!("{result:?}"), format!("{trickle_result:?}"), "{input}");
    (events, result)
}

#[test]
fn the_brand_is_checked_before_any_event_wherever_it_stands() {
    // Brackets, quotes and key names inside strings must not fool the
    // reader that moves an early `places` aside.
    let places = r#"[
        {"place_id": 1, "items": [{"id": "a]\"}[", "title": "\"brand_id\": 8, \"places\": ["},
                                  {"id": "b", "price": "x"}, {"id": "a"}]},
        {"items": [{"id": "c"}], "name": {"places": [1, {"x": "]"}]}},
        {"place_id": 2}]"#;
    let expected = r#"P1 I1/a]"}[ R1/b:wrong_type I1/a R-/-:missing_place P2"#;
    let first = run_both(&format!(r#"{{"brand_id": 7, "places": {places}}}"#));
    assert_eq!(first.0, expected);
    for feed in [
        format!(r#"{{"places": {places}, "brand_id": 7}}"#),
        format!(r#"{{"x": [{{"places": []}}], "places":{places} , "y": "]", "brand_id":7 }}"#),
        format!(r#"{{"places": {places}, "\u0062rand_id": 7}}"#),
        format!(r#"{{"\u0062rand_id": 7, "places": {places}}}"#),
    ] {
        let (events, result) = run_both(&feed);
        result.expect("parses");
        assert_eq!(events, first.0, "{feed}");
    }
    // Several `places`, before and after the brand: document order.
    let (events, result) = run_both(
        r#"{"places": [{"place_id": 1}], "places": [{"place_id": 2}], "brand_id": 7,
            "places": [{"place_id": 3}]}"#,
    );
    result.expect("parses");
    assert_eq!(events, "P1 P2 P3");

    // Wrong, missing, or not a number: nothing at all is handed over,
    // rejections included.
    for (feed, needle) in [
        (format!(r#"{{"places": {places}, "brand_id": 8}}"#), "brand 8"),
        (format!(r#"{{"places": {places}, "br\u0061nd_id": 8}}"#), "brand 8"),
        (format!(r#"{{"places": {places}}}"#), "no top-level `brand_id`"),
        (format!(r#"{{"places": {places}, "meta": {{"brand_id": 7}}}}"#), "no top-level"),
        (format!(r#"{{"places": {places}, "brand_id": "7"}}"#), "must be an integer"),
        (format!(r#"{{"places": {places}, "brand_id": 7"#), "EOF while parsing"),
        (format!(r#"{{"places": {places}, "brand_id": 7}} trailing"#), "trailing"),
        (r#"{"places": [{"place_id": 1, "items": [{"id": "a"}"#.into(), "EOF while parsing"),
        (r#"{"places": "x", "brand_id": 7}"#.into(), "invalid type"),
        (r#"{"places": [{"place_id": 1}, 5, "brand_id": 7}"#.into(), "not counting what"),
    ] {
        let (events, result) = run_both(&feed);
        assert_eq!(events, "", "{feed}: nothing before the brand is known good");
        let err = result.expect_err(&feed).to_string();
        assert!(err.contains(needle), "{feed}: {err}");
    }
    let (events, result) = run_both(&format!(r#"{{"places": {places}, "brand_id": 8}}"#));
    assert!(matches!(result, Err(FeedError::BrandMismatch { expected: 7, found: 8 })));
    assert_eq!(events, "");
    // A `places` that parses badly once the brand is known fails like a
    // streamed one: after what came before, at a position within it.
    let (events, result) = run_both(
        r#"{"places": [{"place_id": 1, "items": [{"id": "a"}, {"id": 1x}]}], "brand_id": 7}"#,
    );
    assert_eq!(events, "P1 I1/a");
    malformed(result, "counted from the start of a `places` read ahead of `brand_id`");
}

#[test]
fn a_brand_id_given_twice_is_malformed() {
    let items = r#"[{"place_id": 1, "items": [{"id": "a"}]}]"#;
    for feed in [
        format!(r#"{{"brand_id": 7, "brand_id": 7, "places": {items}}}"#),
        format!(r#"{{"brand_id": 7, "brand_id": 8, "places": {items}}}"#),
        format!(r#"{{"places": {items}, "brand_id": 7, "brand_id": 7}}"#),
        format!(r#"{{"places": {items}, "brand_id": 7, "places": [], "brand_id": 7}}"#),
    ] {
        let (events, result) = run_both(&feed);
        assert_eq!(events, "", "{feed}");
        malformed(result, "`brand_id` is given twice");
    }
    // After a streamed `places`, the items before it are out already.
    let (events, result) =
        run_both(&format!(r#"{{"brand_id": 7, "places": {items}, "brand_id": 7}}"#));
    assert_eq!(events, "P1 I1/a");
    malformed(result, "`brand_id` is given twice (7, then 7)");
}

/// `prefix`, then `n` bytes of `k`, then `suffix`, made as they are read.
fn huge(prefix: &str, n: u64, suffix: &str) -> impl Read {
    let (prefix, suffix) = (prefix.to_string().into_bytes(), suffix.to_string().into_bytes());
    io::Cursor::new(prefix).chain(io::repeat(b'k').take(n)).chain(io::Cursor::new(suffix))
}

/// Counts the bytes the parser took from its source.
struct Counted<R>(R, Rc<Cell<u64>>);

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.0.read(buf)?;
        self.1.set(self.1.get() + n as u64);
        Ok(n)
    }
}

#[test]
fn a_huge_key_fails_at_the_hard_cap_before_it_is_read_whole() {
    const KEY: u64 = 100 << 20;
    let cases = [
        (r#"{""#, r#"": 1, "brand_id": 7, "places": []}"#, "", "an object key"),
        (r#"{"brand_id": 7, ""#, r#"": 1, "places": []}"#, "", "an object key"),
        (r#"{"brand_id": 7, "places": [{"place_id": 1, ""#, r#"": 1}]}"#, "P1", "an object key"),
        (
            r#"{"brand_id": 7, "places": [{"place_id": 1, "items": [{"id": "a"}, {""#,
            r#"": 1}]}]}"#,
            "P1 I1/a",
            "an item",
        ),
        (r#"{"brand_id": ""#, r#""}"#, "", "the `brand_id` value"),
        (r#"{"brand_id": 7, "places": ""#, r#""}"#, "", "the value of `places`"),
        (r#"{"brand_id": 7, "places": [""#, r#""]}"#, "", "a place"),
    ];
    for (prefix, suffix, expected, what) in cases {
        let read = Rc::new(Cell::new(0));
        let (events, result) =
            run_reader(Counted(huge(prefix, KEY, suffix), read.clone()), FeedFormat::Auto);
        assert_eq!(events, expected, "{prefix}");
        malformed(result, &format!("{what} is larger than"));
        assert!(read.get() < 2 << 20, "{prefix}: {} bytes read of a 100 MB key", read.get());
    }
    // In a `places` spooled ahead of its brand: the copy is on disk, and
    // the key fails when the copy is parsed.
    let (events, result) = run_reader(
        huge(r#"{"places": [{"place_id": 1, ""#, 8 << 20, r#"": 1}], "brand_id": 7}"#),
        FeedFormat::Auto,
    );
    assert_eq!(events, "P1");
    malformed(result, "an object key is larger than");
    // Keys and values under unknown keys are skipped without being read
    // into memory, so there they cost nothing and are ignored.
    let (events, result) = run_reader(
        huge(
            r#"{"brand_id": 7, "meta": {""#,
            KEY,
            r#"": {"x": 1}}, "places": [{"place_id": 1, "items": [{"id": "a"}]}]}"#,
        ),
        FeedFormat::Auto,
    );
    result.expect("skipped");
    assert_eq!(events, "P1 I1/a");
    // A key that makes its item too large, but not huge, rejects that item alone.
    let feed = format!(
        r#"{{"brand_id": 7, "places": [{{"place_id": 1, "items": [{{"id": "a", "{}": 1}}, {{"id": "b"}}]}}]}}"#,
        "k".repeat(2000)
    );
    let (events, result) = run(&feed);
    result.expect("one bad item does not fail the feed");
    assert_eq!(events, "P1 R1/-:too_large I1/b");
}

#[test]
fn the_sink_can_stop_the_parse() {
    let feed = r#"{"brand_id":7,"places":[{"place_id":1,"items":[{"id":"a"},{"id":"b"}]}]}"#;
    let mut n = 0;
    let result = parse_feed(feed.as_bytes(), FeedFormat::Auto, &RULES, &mut |_| {
        n += 1;
        if n == 2 { Err(Stopped) } else { Ok(()) }
    });
    assert!(matches!(result, Err(FeedError::Stopped)), "{result:?}");
    assert_eq!(n, 2);
}

#[test]
fn bounded_lines_keep_a_prefix_and_measure_the_whole() {
    let mut r = io::BufReader::with_capacity(4, &b"abcdefgh\nij\n\nk"[..]);
    let mut buf = Vec::new();
    let mut next = || read_line_bounded(&mut r, &mut buf, 3).expect("reads");
    assert_eq!(
        [next(), next(), next(), next(), next()],
        [Some(8), Some(2), Some(0), Some(1), None]
    );
    read_line_bounded(&mut io::BufReader::new(&b"abcdefgh"[..]), &mut buf, 3).expect("reads");
    assert_eq!(buf, b"abc");
}

/// Events (in full) and the outcome of a parse with the items cut out
/// under serde_json or not.
fn run_cutting(input: impl Read, cutting: bool) -> String {
    let mut events = Vec::new();
    let result = parse(
        input,
        FeedFormat::Json,
        &RULES,
        &mut |e| {
            events.push(e);
            Ok(())
        },
        cutting,
    );
    format!("{events:?}\n{result:?}")
}

/// Cutting items out under serde_json changes nothing anyone sees: not
/// the events, not a rejection's detail, not an error's text or its line
/// and column, on every byte deleted, inserted or cut off of feeds with
/// items on one line and across lines, strings that hold brackets, quotes
/// and escapes, and values nested in items; read whole, a byte at a time,
/// and a few bytes at a time (an item whole in one read is parsed as it is
/// cut, one split across reads is cut by scanning).
#[test]
fn cutting_the_items_out_changes_nothing_seen() {
    let seeds = [
        r#"{"brand_id": 7, "places": [{"place_id": 1, "items": [{"id": "a", "price": 1.5}, {"id": "b", "x": [1, {"y": "}]\"{["}], "s": "q\"\\\u00e9\n"}, 5, "z", [{"id": "n"}], {"id": "a"}, {}]}]}"#,
        "{\n \"brand_id\": 7, \"places\": [\n  {\"place_id\": 1, \"items\": [\n    {\"id\": \"a\",\n     \"price\": 1}, {\"id\": \"b\"}, {\"id\":\n\"c\", \"t\": \"x]\"}  ,  {\"id\": \"e\"}\n  ]},\n  {\"items\": [{\"id\": \"d\"},\n {\"id\": \"f\", \"n\": {\"m\": [\n1]}}], \"place_id\": 2}\n ]\n}\n",
        "{\"places\": [{\"place_id\": 3, \"items\": [{\"id\": \"p\"}]}],\n \"brand_id\": 7, \"places\": [{\"items\": [{\"id\": \"q\", \"price\": \"x\"}], \"place_id\": 4}], \"items\": [{\"id\": 1}]}",
        "{\"brand_id\": 7, \"meta\": {\"places\": [{\"items\": [{\"id\": \"m\"}]}]}, \"places\": [{\"place_id\": 5, \"other\": [{\"items\": [{\"k\": 1}]}], \"\\u0069tems\": [{\"id\": \"u\"} ,{\"id\":\"v\"}]}]}",
    ];
    let inserts: &[u8] = b",}]\"\nx5{[\\: \x01";
    // With the first line cut short, the rest is trickled a byte a read.
    let seeds = seeds.iter().flat_map(|s| [s.to_string(), s.replacen('{', "{\n", 1)]);
    let mut cases = 0;
    for seed in seeds {
        let seed = seed.as_bytes();
        let mut feeds = vec![seed.to_vec()];
        for i in 0..=seed.len() {
            feeds.push(seed[..i].to_vec());
            if i < seed.len() {
                feeds.push([&seed[..i], &seed[i + 1..]].concat());
            }
            for &b in inserts {
                feeds.push([&seed[..i], &[b][..], &seed[i..]].concat());
            }
        }
        for feed in feeds {
            let expected = run_cutting(&feed[..], false);
            let shown = String::from_utf8_lossy(&feed);
            assert_eq!(run_cutting(&feed[..], true), expected, "{shown}");
            // How far the scan for `brand_id` read ahead depends on the reads.
            let expected = run_cutting(Trickle(&feed[..]), false);
            assert_eq!(run_cutting(Trickle(&feed[..]), true), expected, "trickled: {shown}");
            let expected = run_cutting(Chunks(&feed[..], 0), false);
            assert_eq!(run_cutting(Chunks(&feed[..], 0), true), expected, "in chunks: {shown}");
            cases += 1;
        }
    }
    assert!(cases > 6000, "{cases}");
}

/// An item of newlines only is cut off at the hard cap like any other,
/// its placeholder never longer than the bytes it stands for.
#[test]
fn an_item_of_newlines_fails_at_the_hard_cap() {
    let prefix =
        r#"{"brand_id": 7, "places": [{"place_id": 1, "items": [{"id": "a"}, {"#.as_bytes();
    let newlines = io::repeat(b'\n').take(100 << 20);
    let read = Rc::new(Cell::new(0));
    let input = Counted(prefix.chain(newlines).chain(&b"}]}]}"[..]), read.clone());
    let (events, result) = run_reader(input, FeedFormat::Auto);
    assert_eq!(events, "P1 I1/a");
    malformed(result, "an item is larger than");
    assert!(read.get() < 2 << 20, "{} bytes read", read.get());
}

/// An item whole in one read that the item parser's fast path takes is
/// parsed as it is cut; one it leaves to the reference parser, or one split
/// across reads, is cut by scanning. (Were the first never so, the test
/// comparing cut and uncut feeds would pass without ever taking that path.)
/// Each is known by the element it is of its `items` array, so that the
/// walk reads its placeholder without a copy; one that serde_json cannot
/// read as an element (no comma before it) is of none.
#[test]
fn an_item_whole_in_one_read_is_parsed_as_it_is_cut() {
    let feed = "{\"brand_id\": 7, \"places\": [{\"place_id\": 1, \"items\": [{\"id\":\n\"a\"},\
                {\"id\": \"b\", \"price\": 1.5}, 5, [{\"x\": 1}], {\"id\": \"d\"} 6 {\"id\": \"e\"},\
                {\"id\": \"c\"";
    let (mut cut, mut cuts) = (Cut::new(1 << 20, RULES), cut::Cuts::default());
    let mut buf = feed.as_bytes().to_vec();
    let given = cut.filter(&mut buf, &mut cuts);
    let given = String::from_utf8_lossy(&buf[..given]);
    let placeholders = "{\"brand_id\": 7, \"places\": [{\"place_id\": 1, \"items\": [{\n},\
                        {}, 5, [{\"x\": 1}], {} 6 {},{";
    assert_eq!(given, placeholders);
    let mut elements = Vec::new();
    for index in 0..6 {
        if cuts.waiting(cut::Slot { array: 1, index }) {
            let item = cuts.next().expect("waiting");
            elements.push((index, item.item.map(|item| item.id)));
        }
    }
    assert_eq!(elements, [(0, Some("a".into())), (1, None), (4, Some("d".into()))]);
    assert!(!cuts.waiting(cut::Slot { array: 1, index: 4 }), "`e` is not the element `d` was");
    let of_none = cuts.next().expect("cut").item.map(|item| item.id);
    assert_eq!(of_none, Some("e".into()));
    assert!(cuts.next().is_none(), "`c` is still being cut");
}
