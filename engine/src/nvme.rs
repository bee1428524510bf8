//! The NVMe tier: a scratch swap file holding optimizer state the compiler offloads to an NVMe
//! drive. The engine writes a buffer's bytes into a *region* of the file and reads them back
//! before the buffer is used.
//!
//! # On-disk layout
//!
//! One file, `dir/<file_name>`, reserved up front with `posix_fallocate` to the requested size
//! (rounded up to 4096 bytes), so a full disk is reported when the store is created rather than
//! halfway through a training run. The file is split into blocks of [`NVME_BLOCK`] bytes (1 MiB);
//! a region starts on a block boundary (its offset is a multiple of [`NVME_BLOCK`]) and covers
//! `ceil(len / NVME_BLOCK)` consecutive blocks. Block `i` lives at byte `i * NVME_BLOCK`; only
//! the final block of a region may be partial. There is no header: all metadata is in memory.
//!
//! For every block the store keeps, in memory, the CRC32 (`crc32fast`) and the length of the
//! payload last written there. Every read re-computes the CRC32 of each block and compares it,
//! and checks that the file still holds the block's payload. This detects a truncated or
//! bit-flipped swap file (another process, a full or failing drive, a filesystem bug) *before*
//! corrupt optimizer state is fed back into training, where it would silently poison the run.
//! The file is scratch space: it is deleted when the [`NvmeStore`] is dropped and is not meant
//! to survive the process.
//!
//! # I/O
//!
//! Reads and writes are positional ([`FileExt::read_at`] / [`FileExt::write_at`]); the blocks
//! of one call are processed in parallel on a small private thread pool when there are several.
//! The file is opened with `O_DIRECT` when the filesystem allows it, bypassing the page cache
//! (the data is read once per step and would only evict more useful pages): transfers then go
//! through 4096-aligned heap buffers and are padded to a multiple of 4096 bytes, the padding of a
//! partial last block being zeros (only the payload bytes are checksummed). When the filesystem
//! refuses `O_DIRECT` (`EINVAL` at open or at the first transfer, e.g. tmpfs) the store falls
//! back to ordinary buffered I/O; [`NvmeStats::direct_io`] says which mode is in use.
use std::alloc::{self, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Component, Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use rayon::prelude::*;
use thiserror::Error;

/// Bytes per checksummed block (1 MiB). Region offsets must be multiples of it.
pub const NVME_BLOCK: usize = 1 << 20;

/// Alignment (bytes) of `O_DIRECT` buffers, offsets and transfer lengths.
const DIRECT_ALIGN: usize = 4096;

/// Most threads the per-store pool uses.
const MAX_IO_THREADS: usize = 4;

/// Anything that can go wrong in the NVMe tier. Every message names the swap file.
#[derive(Debug, Error)]
pub enum NvmeError {
    /// The operating system refused an operation (open, reserve, read, write). A full disk
    /// (`ENOSPC` / `EFBIG`) says so, with the number of bytes asked for and what to do.
    #[error("NVMe store {}: {what}: {source}", path.display())]
    Io {
        /// The swap file (or the path that could not be created).
        path: PathBuf,
        /// What was being done, as a sentence.
        what: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// An offset that is not a multiple of [`NVME_BLOCK`], or a region past the reserved bytes.
    #[error(
        "NVMe store {}: region at offset {offset} with {len} bytes is not allowed: {why} \
         (offsets must be multiples of NVME_BLOCK = {} bytes and offset + len <= {reserved} \
         reserved bytes)",
        path.display(),
        NVME_BLOCK
    )]
    Range {
        /// The swap file.
        path: PathBuf,
        /// Requested byte offset.
        offset: u64,
        /// Requested length in bytes.
        len: u64,
        /// Bytes reserved for the store ([`NvmeStore::reserved_bytes`]).
        reserved: u64,
        /// What is wrong with the request.
        why: String,
    },
    /// The file ended before a block's payload: the swap file was truncated.
    #[error(
        "NVMe store {}: block {block} at byte offset {offset} is truncated: wanted {wanted} \
         bytes, only {got} are left in the file (the swap file was cut short)",
        path.display()
    )]
    Truncated {
        /// The swap file.
        path: PathBuf,
        /// Block index (`offset / NVME_BLOCK`).
        block: u64,
        /// Byte offset of the block in the file.
        offset: u64,
        /// Payload bytes expected.
        wanted: u64,
        /// Bytes actually read.
        got: u64,
    },
    /// A block's CRC32 differs from the one recorded when it was written.
    #[error(
        "NVMe store {}: block {block} at byte offset {offset} is corrupt: CRC32 {found:#010x} \
         read back, {expected:#010x} written (the swap file changed on disk)",
        path.display()
    )]
    Corrupt {
        /// The swap file.
        path: PathBuf,
        /// Block index (`offset / NVME_BLOCK`).
        block: u64,
        /// Byte offset of the block in the file.
        offset: u64,
        /// CRC32 recorded at write time.
        expected: u32,
        /// CRC32 of the bytes read back.
        found: u32,
    },
    /// A read touched a block that was never written (or whose write failed).
    #[error("NVMe store {}: block {block} was never written", path.display())]
    Unwritten {
        /// The swap file.
        path: PathBuf,
        /// Block index (`offset / NVME_BLOCK`).
        block: u64,
    },
    /// A read asked a block for a different number of bytes than were written there.
    #[error(
        "NVMe store {}: block {block} holds {written} bytes but the read asks for {requested} \
         (a region must be read back with the length it was written with)",
        path.display()
    )]
    LengthMismatch {
        /// The swap file.
        path: PathBuf,
        /// Block index (`offset / NVME_BLOCK`).
        block: u64,
        /// Payload bytes written in this block.
        written: u64,
        /// Bytes this read wants from this block.
        requested: u64,
    },
}

/// Cumulative I/O counters of one [`NvmeStore`].
#[derive(Clone, Copy, Debug, Default)]
pub struct NvmeStats {
    /// Payload bytes read back by successful [`NvmeStore::read`] calls (padding excluded).
    pub bytes_read: u64,
    /// Payload bytes written by successful [`NvmeStore::write`] calls (padding excluded).
    pub bytes_written: u64,
    /// Wall-clock milliseconds spent in successful reads.
    pub read_ms: f64,
    /// Wall-clock milliseconds spent in successful writes.
    pub write_ms: f64,
    /// Whether transfers currently bypass the page cache (`O_DIRECT`).
    pub direct_io: bool,
}

/// What is known about one block: the CRC32 and length of the payload last written to it.
#[derive(Clone, Copy, Debug)]
struct BlockMeta {
    crc: u32,
    len: u32,
}

/// A scratch swap file on the NVMe tier, with per-block checksums kept in memory.
///
/// Created with [`NvmeStore::create`]; the file is removed when the store is dropped.
/// `read` and `write` take `&self` and the store is `Send + Sync`, so reads and writes of
/// different regions may run at once on different threads (the CUDA engine's writer thread
/// writes while its engine thread reads); the caller orders a read of a region after the
/// write of that region it must see.
pub struct NvmeStore {
    path: PathBuf,
    dir: PathBuf,
    /// A buffered handle: all transfers when `O_DIRECT` is unavailable.
    file: File,
    /// An `O_DIRECT` handle, when the filesystem accepted one at open.
    direct_file: Option<File>,
    /// Whether transfers go through `direct_file` (cleared if the filesystem refuses them).
    direct: AtomicBool,
    reserved: u64,
    /// Per block, the payload last written there (locked only to read or update entries).
    blocks: Mutex<Vec<Option<BlockMeta>>>,
    pool: Option<rayon::ThreadPool>,
    stats: Mutex<NvmeStats>,
}

impl std::fmt::Debug for NvmeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeStore")
            .field("path", &self.path)
            .field("reserved", &self.reserved)
            .field("direct_io", &self.direct.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

fn is_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EFBIG))
}

fn is_einval(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// A zero-initialised heap buffer aligned to [`DIRECT_ALIGN`], for `O_DIRECT` transfers.
struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// The buffer owns its allocation exclusively, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// `len` must be non-zero; returns an `OutOfMemory` error rather than aborting.
    fn zeroed(len: usize) -> io::Result<AlignedBuf> {
        let layout = Layout::from_size_align(len.max(1), DIRECT_ALIGN)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("cannot allocate a {len}-byte aligned I/O buffer"),
            )
        })?;
        Ok(AlignedBuf { ptr, len })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed) bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout (which was valid then).
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len.max(1), DIRECT_ALIGN),
            )
        }
    }
}

/// Reads into `buf` from `offset` until it is full or the file ends; returns the bytes read.
///
/// With `direct`, a count that is not a multiple of 4096 means the file ended (retrying at an
/// unaligned offset would be refused with `EINVAL`, which is not a refusal of `O_DIRECT`).
fn read_full_at(file: &File, buf: &mut [u8], offset: u64, direct: bool) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) if direct && n % DIRECT_ALIGN != 0 => {
                got += n;
                break;
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Outcome of one block's transfer.
enum BlockError {
    /// An OS error.
    Io(io::Error),
    /// The file ended after `got` bytes of the block.
    Short { got: u64 },
    /// The CRC32 differs.
    Crc { found: u32 },
}

impl NvmeStore {
    /// Creates `dir/<file_name>` (the dir must exist; an existing file is replaced) and reserves
    /// `bytes` on the device up front with `posix_fallocate` (rounded up to a multiple of 4096),
    /// so a full disk is an error at start, not mid-run.
    ///
    /// Opens the file with `O_DIRECT` when the filesystem accepts it (checked with one 4096-byte
    /// transfer), otherwise with buffered I/O ([`NvmeStats::direct_io`] tells which).
    ///
    /// # Errors
    /// [`NvmeError::Io`] when `file_name` is not a single path component, the file cannot be
    /// created (e.g. `dir` does not exist), or the reservation fails; a full disk (`ENOSPC`,
    /// `EFBIG`, or a size beyond what a file can hold) says that the NVMe tier is full and how
    /// many bytes were asked, and suggests lowering `nvme_memory` or freeing space in `dir`.
    /// No file is left behind on error.
    pub fn create(dir: &Path, file_name: &str, bytes: u64) -> Result<NvmeStore, NvmeError> {
        Self::create_impl(dir, file_name, bytes, true)
    }

    /// Like [`NvmeStore::create`], but never uses `O_DIRECT`: all transfers go through the page
    /// cache. Same units, alignment rules and errors.
    pub fn create_buffered(
        dir: &Path,
        file_name: &str,
        bytes: u64,
    ) -> Result<NvmeStore, NvmeError> {
        Self::create_impl(dir, file_name, bytes, false)
    }

    fn create_impl(
        dir: &Path,
        file_name: &str,
        bytes: u64,
        try_direct: bool,
    ) -> Result<NvmeStore, NvmeError> {
        let path = dir.join(file_name);
        let mut components = Path::new(file_name).components();
        if !matches!(
            (components.next(), components.next()),
            (Some(Component::Normal(_)), None)
        ) {
            return Err(NvmeError::Io {
                path,
                what: format!(
                    "file name `{file_name}` must be a single path component inside {}",
                    dir.display()
                ),
                source: io::Error::new(io::ErrorKind::InvalidInput, "bad file name"),
            });
        }

        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) => {
                return Err(NvmeError::Io {
                    what: format!(
                        "cannot create the swap file (does the directory {} exist and is it \
                         writable?)",
                        dir.display()
                    ),
                    path,
                    source: e,
                })
            }
        };

        // From here on a failure must remove the file we created.
        let fail = |path: PathBuf, err: NvmeError| -> NvmeError {
            let _ = std::fs::remove_file(&path);
            err
        };

        let open_direct = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
        };
        let mut direct_file = match try_direct.then(open_direct) {
            None => None,
            Some(Ok(f)) => Some(f),
            Some(Err(e)) if is_einval(&e) => {
                tracing::info!(
                    path = %path.display(),
                    "NVMe tier: the filesystem refuses O_DIRECT at open; using buffered I/O"
                );
                None
            }
            Some(Err(e)) => {
                return Err(fail(
                    path.clone(),
                    NvmeError::Io {
                        path,
                        what: "cannot open the swap file with O_DIRECT".into(),
                        source: e,
                    },
                ))
            }
        };

        let full_message = |bytes: u64| {
            format!(
                "the NVMe tier is full: reserving {bytes} bytes for the swap file failed; lower \
                 `nvme_memory` or free space in {}",
                dir.display()
            )
        };
        // Reserve whole 4096-byte pages so padded O_DIRECT writes stay inside the reservation.
        let on_disk = bytes
            .checked_add(DIRECT_ALIGN as u64 - 1)
            .map(|b| b / DIRECT_ALIGN as u64 * DIRECT_ALIGN as u64)
            .filter(|&b| b <= i64::MAX as u64);
        let Some(on_disk) = on_disk else {
            let source = io::Error::from_raw_os_error(libc::EFBIG);
            return Err(fail(
                path.clone(),
                NvmeError::Io {
                    path,
                    what: full_message(bytes),
                    source,
                },
            ));
        };
        if on_disk > 0 {
            // SAFETY: plain syscall on a file descriptor we own; `on_disk` fits in off_t.
            let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, on_disk as libc::off_t) };
            if rc != 0 {
                let source = io::Error::from_raw_os_error(rc);
                let what = if is_full(&source) {
                    full_message(bytes)
                } else {
                    format!("cannot reserve {bytes} bytes with posix_fallocate")
                };
                return Err(fail(path.clone(), NvmeError::Io { path, what, source }));
            }
        }

        // Probe O_DIRECT with one aligned transfer: some filesystems accept the flag at open
        // and refuse the I/O itself. (The reserved file reads as zeros, so this changes nothing.)
        if let (Some(df), true) = (&direct_file, on_disk > 0) {
            let probe = AlignedBuf::zeroed(DIRECT_ALIGN).and_then(|buf| {
                df.write_all_at(buf.as_slice(), 0)?;
                Ok(())
            });
            match probe {
                Ok(()) => {}
                Err(e) if is_einval(&e) => {
                    tracing::info!(
                        path = %path.display(),
                        "NVMe tier: the filesystem refuses O_DIRECT transfers; using buffered I/O"
                    );
                    direct_file = None;
                }
                Err(e) => {
                    return Err(fail(
                        path.clone(),
                        NvmeError::Io {
                            path,
                            what: "cannot write to the swap file".into(),
                            source: e,
                        },
                    ))
                }
            }
        }

        let n_blocks = match usize::try_from(bytes.div_ceil(NVME_BLOCK as u64)) {
            Ok(n) => n,
            Err(_) => {
                return Err(fail(
                    path.clone(),
                    NvmeError::Io {
                        path,
                        what: full_message(bytes),
                        source: io::Error::from_raw_os_error(libc::EFBIG),
                    },
                ))
            }
        };
        let mut blocks = Vec::new();
        if let Err(e) = blocks.try_reserve_exact(n_blocks) {
            return Err(fail(
                path.clone(),
                NvmeError::Io {
                    path,
                    what: format!("cannot allocate checksums for {n_blocks} blocks"),
                    source: io::Error::new(io::ErrorKind::OutOfMemory, e),
                },
            ));
        }
        blocks.resize(n_blocks, None);

        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, MAX_IO_THREADS);
        let pool = match rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("asteria-nvme-{i}"))
            .build()
        {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(
                    path = %path.display(),
                    error = %e,
                    "NVMe tier: no I/O thread pool; blocks are transferred one at a time"
                );
                None
            }
        };

        let direct = direct_file.is_some();
        if direct {
            tracing::info!(path = %path.display(), bytes, "NVMe tier: swap file ready (O_DIRECT)");
        } else {
            tracing::info!(path = %path.display(), bytes, "NVMe tier: swap file ready (buffered I/O)");
        }
        Ok(NvmeStore {
            dir: dir.to_path_buf(),
            path,
            file,
            direct_file,
            direct: AtomicBool::new(direct),
            reserved: bytes,
            blocks: Mutex::new(blocks),
            pool,
            stats: Mutex::new(NvmeStats {
                direct_io: direct,
                ..NvmeStats::default()
            }),
        })
    }

    /// The swap file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes reserved at creation: regions must end at or before this offset.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    /// Cumulative counters (payload bytes and wall-clock milliseconds of successful calls) and
    /// whether `O_DIRECT` is in use.
    pub fn stats(&self) -> NvmeStats {
        let mut s = self
            .stats
            .lock()
            .map(|s| *s)
            .unwrap_or_else(|p| *p.into_inner());
        s.direct_io = self.direct.load(Ordering::Relaxed);
        s
    }

    /// Checks that `[offset, offset + len)` is a block-aligned region inside the reservation.
    fn check_range(&self, offset: u64, len: usize) -> Result<(), NvmeError> {
        let range_err = |why: String| NvmeError::Range {
            path: self.path.clone(),
            offset,
            len: len as u64,
            reserved: self.reserved,
            why,
        };
        if offset % NVME_BLOCK as u64 != 0 {
            return Err(range_err(format!(
                "offset {offset} is not a multiple of {NVME_BLOCK}"
            )));
        }
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.reserved => Ok(()),
            _ => Err(range_err(format!(
                "the region ends past the reservation (allowed: [0, {}))",
                self.reserved
            ))),
        }
    }

    /// Runs `f` over the items, in parallel on the pool when there are several.
    fn run_blocks<I, T, F>(&self, items: Vec<I>, f: F) -> Vec<T>
    where
        I: Send,
        T: Send,
        F: Fn(I) -> T + Sync + Send,
    {
        match &self.pool {
            Some(pool) if items.len() > 1 => {
                pool.install(|| items.into_par_iter().map(&f).collect())
            }
            _ => items.into_iter().map(f).collect(),
        }
    }

    /// Switches to buffered I/O after `O_DIRECT` was refused by a transfer. Logs once.
    fn direct_refused(&self) {
        if self.direct.swap(false, Ordering::Relaxed) {
            tracing::info!(
                path = %self.path.display(),
                "NVMe tier: the filesystem refused an O_DIRECT transfer; using buffered I/O"
            );
        }
    }

    /// The `O_DIRECT` handle, while direct transfers are in use.
    fn direct_file(&self) -> Option<&File> {
        self.direct_file
            .as_ref()
            .filter(|_| self.direct.load(Ordering::Relaxed))
    }

    /// Writes one block's payload at `pos`.
    fn write_block(&self, pos: u64, payload: &[u8]) -> io::Result<()> {
        if let Some(df) = self.direct_file() {
            // Block-sized, 4096-padded transfer from an aligned buffer; the padding is zeros.
            let mut buf = AlignedBuf::zeroed(round_up(payload.len(), DIRECT_ALIGN))?;
            buf.as_mut_slice()[..payload.len()].copy_from_slice(payload);
            match df.write_all_at(buf.as_slice(), pos) {
                Ok(()) => return Ok(()),
                Err(e) if is_einval(&e) => self.direct_refused(),
                Err(e) => return Err(e),
            }
        }
        self.file.write_all_at(payload, pos)
    }

    /// Reads one block's payload at `pos` into `out` and returns its CRC32.
    fn read_block(&self, pos: u64, out: &mut [u8]) -> Result<u32, BlockError> {
        if let Some(df) = self.direct_file() {
            let mut buf =
                AlignedBuf::zeroed(round_up(out.len(), DIRECT_ALIGN)).map_err(BlockError::Io)?;
            match read_full_at(df, buf.as_mut_slice(), pos, true) {
                Ok(got) if got < out.len() => return Err(BlockError::Short { got: got as u64 }),
                Ok(_) => {
                    out.copy_from_slice(&buf.as_slice()[..out.len()]);
                    return Ok(crc32fast::hash(out));
                }
                Err(e) if is_einval(&e) => self.direct_refused(),
                Err(e) => return Err(BlockError::Io(e)),
            }
        }
        let got = read_full_at(&self.file, out, pos, false).map_err(BlockError::Io)?;
        if got < out.len() {
            return Err(BlockError::Short { got: got as u64 });
        }
        Ok(crc32fast::hash(out))
    }

    /// Writes `data` at byte `offset` of the swap file, block by block ([`NVME_BLOCK`] bytes
    /// each, the last one possibly partial), recording each block's CRC32 and length in memory.
    ///
    /// `offset` must be a multiple of [`NVME_BLOCK`] and `offset + data.len()` must not exceed
    /// [`NvmeStore::reserved_bytes`]. Overwriting a region replaces the checksums of the blocks
    /// it covers. An empty `data` writes nothing.
    ///
    /// # Errors
    /// [`NvmeError::Range`] for a misaligned or out-of-range region (nothing is written);
    /// [`NvmeError::Io`] when the OS refuses the write (a full disk says the NVMe tier is full
    /// and suggests lowering `nvme_memory`). Blocks whose write failed are marked unwritten.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), NvmeError> {
        self.check_range(offset, data.len())?;
        let start = Instant::now();
        let first = (offset / NVME_BLOCK as u64) as usize;
        let items: Vec<(usize, &[u8])> = data.chunks(NVME_BLOCK).enumerate().collect();
        let results = self.run_blocks(items, |(i, payload)| {
            let pos = offset + (i * NVME_BLOCK) as u64;
            self.write_block(pos, payload).map(|()| BlockMeta {
                crc: crc32fast::hash(payload),
                len: payload.len() as u32,
            })
        });
        let mut first_err = None;
        let mut blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        for (i, r) in results.into_iter().enumerate() {
            let block = first + i;
            match r {
                Ok(meta) => blocks[block] = Some(meta),
                Err(e) => {
                    blocks[block] = None;
                    if first_err.is_none() {
                        first_err = Some((block, e));
                    }
                }
            }
        }
        drop(blocks);
        if let Some((block, e)) = first_err {
            let what = if is_full(&e) {
                format!(
                    "the NVMe tier is full: writing {} bytes at offset {offset} failed at block \
                     {block}; lower `nvme_memory` or free space in {}",
                    data.len(),
                    self.dir.display()
                )
            } else {
                format!(
                    "cannot write block {block} (byte offset {}) of a {}-byte region",
                    block * NVME_BLOCK,
                    data.len()
                )
            };
            return Err(NvmeError::Io {
                path: self.path.clone(),
                what,
                source: e,
            });
        }
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if let Ok(mut s) = self.stats.lock() {
            s.bytes_written += data.len() as u64;
            s.write_ms += ms;
        }
        Ok(())
    }

    /// Reads `out.len()` bytes from byte `offset` of the swap file and verifies every block's
    /// CRC32 against the one recorded by [`NvmeStore::write`].
    ///
    /// `offset` must be a multiple of [`NVME_BLOCK`] and `offset + out.len()` must not exceed
    /// [`NvmeStore::reserved_bytes`]; each block must be read with the length it was written
    /// with (read a region back whole, or a prefix of whole blocks). An empty `out` reads
    /// nothing. On error the contents of `out` are unspecified.
    ///
    /// # Errors
    /// [`NvmeError::Range`] for a misaligned or out-of-range region; [`NvmeError::Unwritten`]
    /// for a block never written; [`NvmeError::LengthMismatch`] when a block holds a different
    /// number of bytes; [`NvmeError::Truncated`] when the file ends inside a block;
    /// [`NvmeError::Corrupt`] on a checksum mismatch; [`NvmeError::Io`] for OS errors. With
    /// several failing blocks the lowest-numbered one is reported.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), NvmeError> {
        self.check_range(offset, out.len())?;
        let start = Instant::now();
        let first = (offset / NVME_BLOCK as u64) as usize;
        let len = out.len();
        // Check the metadata of every block before any I/O.
        let mut metas = Vec::with_capacity(len.div_ceil(NVME_BLOCK));
        let blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        for (i, chunk_start) in (0..len).step_by(NVME_BLOCK).enumerate() {
            let block = first + i;
            let want = (len - chunk_start).min(NVME_BLOCK);
            let Some(meta) = blocks[block] else {
                return Err(NvmeError::Unwritten {
                    path: self.path.clone(),
                    block: block as u64,
                });
            };
            if meta.len as usize != want {
                return Err(NvmeError::LengthMismatch {
                    path: self.path.clone(),
                    block: block as u64,
                    written: meta.len as u64,
                    requested: want as u64,
                });
            }
            metas.push(meta);
        }
        drop(blocks);
        let items: Vec<(usize, &mut [u8])> = out.chunks_mut(NVME_BLOCK).enumerate().collect();
        let results = self.run_blocks(items, |(i, chunk)| {
            let pos = offset + (i * NVME_BLOCK) as u64;
            let wanted = chunk.len() as u64;
            self.read_block(pos, chunk)
                .and_then(|crc| {
                    if crc == metas[i].crc {
                        Ok(())
                    } else {
                        Err(BlockError::Crc { found: crc })
                    }
                })
                .map_err(|e| (i, wanted, e))
        });
        if let Some(Err((i, wanted, e))) = results.into_iter().find(|r| r.is_err()) {
            let block = (first + i) as u64;
            let pos = offset + (i * NVME_BLOCK) as u64;
            let path = self.path.clone();
            return Err(match e {
                BlockError::Io(source) => NvmeError::Io {
                    path,
                    what: format!("cannot read block {block} (byte offset {pos})"),
                    source,
                },
                BlockError::Short { got } => NvmeError::Truncated {
                    path,
                    block,
                    offset: pos,
                    wanted,
                    got,
                },
                BlockError::Crc { found } => NvmeError::Corrupt {
                    path,
                    block,
                    offset: pos,
                    expected: metas[i].crc,
                    found,
                },
            });
        }
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if let Ok(mut s) = self.stats.lock() {
            s.bytes_read += len as u64;
            s.read_ms += ms;
        }
        Ok(())
    }
}

impl Drop for NvmeStore {
    /// Removes the swap file: it is scratch space.
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(
                    path = %self.path.display(),
                    error = %e,
                    "NVMe tier: cannot remove the swap file"
                );
            }
        }
    }
}

/// Stores created by [`plan_store`] in this process so far (each gets its own file name).
static PLAN_STORES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The swap file of an engine running `plan`: `asteria-<plan>-<pid>.nvme` for the process's
/// first store, `asteria-<plan>-<pid>.<n>.nvme` for the n-th after it (the train-match runs the
/// CPU and the CUDA engine in one process, each with its own file).
fn plan_file_name(plan: &schedule::Plan) -> String {
    let n = PLAN_STORES.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    if n == 0 {
        format!("asteria-{}-{pid}.nvme", plan.name)
    } else {
        format!("asteria-{}-{pid}.{n}.nvme", plan.name)
    }
}

/// The NVMe store of `plan`'s `nvme` arena for an engine whose floats take `scale` times the
/// plan's f32 bytes (1 for f32 engines, 2 for the CPU engine's f64 mode): one file in the
/// plan's NVMe directory (`plan.memory.budgets.nvme_dir`, spec key `nvme`) reserving
/// `scale ×` the arena's bytes, or `None` when the plan places nothing on NVMe. Buffer `i`'s
/// region starts at byte `scale × slot offset` ([`plan_regions`]). Shared by the CPU and CUDA
/// engines.
///
/// # Errors
/// [`crate::EngineError::Tier`]: no directory in the plan, a directory that does not exist,
/// or [`NvmeStore::create`]'s errors (a full disk).
pub fn plan_store(
    plan: &schedule::Plan,
    scale: u64,
) -> Result<Option<NvmeStore>, crate::EngineError> {
    let tier_err = |e: String| crate::EngineError::Tier(e);
    let bytes = plan.memory.arena_bytes(schedule::ArenaKind::Nvme) as u64 * scale;
    if bytes == 0 {
        return Ok(None);
    }
    let dir =
        plan.memory.budgets.nvme_dir.as_deref().ok_or_else(|| {
            tier_err("the plan places buffers on NVMe but names no directory".into())
        })?;
    let dir = Path::new(dir);
    if !dir.is_dir() {
        return Err(tier_err(format!(
            "the NVMe directory `{}` (spec key `nvme`) does not exist or is not a directory",
            dir.display()
        )));
    }
    NvmeStore::create(dir, &plan_file_name(plan), bytes)
        .map(Some)
        .map_err(|e| tier_err(e.to_string()))
}

/// Per plan buffer, the byte offset of its region in the [`plan_store`] of the same `scale`
/// (`None` for buffers not in the `nvme` arena).
pub fn plan_regions(plan: &schedule::Plan, scale: u64) -> Vec<Option<u64>> {
    (0..plan.buffers.len())
        .map(|i| {
            plan.memory
                .slots
                .get(i)
                .filter(|s| s.arena == schedule::ArenaKind::Nvme)
                .map(|s| s.offset as u64 * scale)
        })
        .collect()
}
