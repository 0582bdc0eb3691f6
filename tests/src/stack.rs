//! The pieces most tests start the same way: the test's own servers,
//! settings without scheduled keyframes, a [`Harness`] on them and storage
//! in this process ([`Stack`]); with ingest's importer and a folder for
//! feed files on top ([`Importing`]).

use shelfsync_ingest::{ImportConfig, ImportError, ImportReport, Importer, Source};
use shelfsync_settings::{PartnerSettings, Settings};
use shelfsync_testkit::TestEnv;

use crate::{Harness, InProcessStorage, now_us, settings_for};

/// Settings for a test that runs storage: [`settings_for`] without
/// scheduled keyframes (a test that wants them asks for them).
pub fn storage_settings(env: &TestEnv) -> Settings {
    let mut settings = settings_for(env);
    settings.storage.keyframe_schedule = String::new();
    settings
}

/// A test's servers, its settings, a harness and storage in this process.
/// Keep `env` bound for as long as the test runs: dropping it stops the
/// servers.
pub struct Stack {
    pub h: Harness,
    pub storage: InProcessStorage,
    pub settings: Settings,
    pub env: TestEnv,
}

impl Stack {
    /// New servers, [`storage_settings`] for them, a harness and storage.
    pub async fn start() -> Stack {
        Stack::start_with(|_| {}).await
    }

    /// As [`Stack::start`], with `tune` applied to the settings first.
    pub async fn start_with(tune: impl FnOnce(&mut Settings)) -> Stack {
        let env = TestEnv::start().await.expect("servers");
        Stack::on(env, tune).await
    }

    /// As [`Stack::start_with`], on servers the test started itself.
    pub async fn on(env: TestEnv, tune: impl FnOnce(&mut Settings)) -> Stack {
        let mut settings = storage_settings(&env);
        tune(&mut settings);
        let h = Harness::connect(settings.clone()).await.expect("harness");
        let storage = InProcessStorage::start(settings.clone()).await.expect("storage");
        Stack { h, storage, settings, env }
    }
}

/// A [`Stack`] with partners, ingest's importer on it and a folder for the
/// feed files the test imports.
pub struct Importing {
    pub h: Harness,
    pub storage: InProcessStorage,
    pub importer: Importer,
    pub settings: Settings,
    pub dir: tempfile::TempDir,
    pub env: TestEnv,
}

impl Importing {
    pub async fn start(partners: Vec<PartnerSettings>) -> Importing {
        Importing::start_with(partners, |_| {}).await
    }

    /// As [`Importing::start`], with `tune` applied to the settings too.
    pub async fn start_with(
        partners: Vec<PartnerSettings>,
        tune: impl FnOnce(&mut Settings),
    ) -> Importing {
        let Stack { h, storage, settings, env } = Stack::start_with(|s| {
            s.partners = partners;
            tune(s);
        })
        .await;
        let importer = Importer::connect(ImportConfig::from(&settings)).await.expect("importer");
        let dir = tempfile::tempdir().expect("tmp");
        Importing { h, storage, importer, settings, dir, env }
    }

    /// Writes `body` to a file and imports it as `partner`; waits until
    /// storage applied everything, whether the import failed or not.
    pub async fn import(
        &self,
        partner: &str,
        body: impl AsRef<[u8]>,
    ) -> Result<ImportReport, ImportError> {
        let path = self.dir.path().join(format!("{partner}-{}.json", now_us()));
        std::fs::write(&path, body).expect("write feed");
        let p = self.settings.partner(partner).expect("partner").clone();
        let result = self.importer.import(&p, Source::File(path), None).await;
        self.h.wait_settled().await;
        result
    }
}
