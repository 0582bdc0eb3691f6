//! What identifies one version of a file that is read again when it
//! changes (the API and push token files).

use std::path::Path;
use std::time::SystemTime;

/// What identifies one version of a file: a rewrite changes the
/// modification time or the size, an atomic replace (a Kubernetes secret
/// update swaps a symlink) the inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileSignature {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl FileSignature {
    /// The signature of the file at `path` now.
    pub fn of(path: &Path) -> std::io::Result<FileSignature> {
        let meta = std::fs::metadata(path)?;
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(&meta);
        #[cfg(not(unix))]
        let inode = 0;
        Ok(FileSignature { modified: meta.modified().ok(), len: meta.len(), inode })
    }
}
