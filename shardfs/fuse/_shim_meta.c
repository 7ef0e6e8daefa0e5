/*
 * Metadata answered in C from the tree's arrays (part of _shim.c; see docs/pyfuse3.md).
 *
 * The tree (shardfs/catalog/tree.py) is immutable for the life of the mount and lives in flat
 * arrays, so LOOKUP, GETATTR, OPENDIR, READDIR(PLUS), RELEASEDIR and FORGET need nothing from
 * Python: answering them here saves the ~20-90 us a pyfuse3 round trip costs per request
 * (a LOOKUP per file after drop_caches; an entry per file in a listing). The answers must be
 * exactly those of shardfs/fuse/ops.py (the path without the shim); a test compares both.
 * Worker processes are forked after the session exists and inherit these pointers.
 */
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>

/* Mirrors shim.py's MetaTree (ctypes.Structure): keep both in step. */
struct meta_tree {
    const char *names;          /* all names, concatenated */
    const uint64_t *name_end;   /* entry i's name ends here in `names` */
    const uint8_t *kind;        /* 'f', 'd' or 'l' */
    const uint64_t *size;
    const int64_t *mtime;
    const uint16_t *mode;
    const uint32_t *children;   /* entry positions, per directory, sorted by name */
    const uint32_t *child_start;
    const uint32_t *child_count;
    uint64_t entries;
    const uint32_t *link_entry; /* symlinks' entry positions, ascending */
    const uint64_t *link_size;  /* their target lengths (st_size) */
    uint64_t links;
    const uint32_t *shard;      /* a file's shard, and where its bytes start in it */
    const uint64_t *offset;
    const uint32_t *sparse_entry; /* sparse files' entry positions, ascending (Python reads) */
    uint64_t sparse;
    uint32_t uid, gid;
    double timeout;             /* entry and attribute timeout, seconds */
    int readdirplus;            /* READDIRPLUS_*, below */
};

/* How listings are answered (shim.py's READDIRPLUS_MODES: keep both in step). */
enum {
    READDIRPLUS_NEVER,      /* plain READDIR: names, inode numbers, types */
    READDIRPLUS_ADAPTIVE,   /* READDIRPLUS for a directory's first reply (the kernel's choice) */
    READDIRPLUS_ALWAYS,     /* READDIRPLUS, every entry with its attributes (an inode each) */
    READDIRPLUS_PUSHING,    /* READDIRPLUS; attributes only while pages are pushed (below) */
};

#define KIND_FILE 'f'
#define KIND_DIR 'd'
#define KIND_LINK 'l'

typedef void (*init_fn_t)(void *, struct fuse_conn_info *);
typedef void (*lookup_fn_t)(fuse_req_t, fuse_ino_t, const char *);

static struct meta_tree meta;
static int meta_ready, meta_installed;

/*
 * What the page push (below) needs to know per file, in memory shared with the worker
 * processes (an anonymous shared mapping made before any of them is forked):
 * `read[i]` is set by the first READ of entry i that any process of the mount receives (its
 * pages are then in the page cache, or on their way: pushing them again would copy for
 * nothing); `listing_inodes`, set while pages are pushed, has listings give every entry its
 * attributes (READDIRPLUS_PUSHING), so that the kernel makes the inodes the push stores into
 * while a loader lists its directories (ImageFolder), where it would otherwise take one
 * LOOKUP round trip per file, the pusher's or the reader's (docs/tuning.md).
 */
struct file_marks {
    int32_t listing_inodes;
    int32_t unused;
    uint8_t read[];
};
static struct file_marks *marks;
static size_t marks_size;
/* Directories the page push had listed already (this process's own: only its push thread
 * uses it); NULL: files are looked up one by one. */
static uint8_t *dirs_asked;

static void mark_read(fuse_ino_t ino)
{
    if (marks != NULL && ino >= 1 && ino <= meta.entries
        && !__atomic_load_n(&marks->read[ino - 1], __ATOMIC_RELAXED))
        __atomic_store_n(&marks->read[ino - 1], 1, __ATOMIC_RELAXED);
}

static int was_read(uint64_t i)
{
    return marks != NULL && __atomic_load_n(&marks->read[i], __ATOMIC_RELAXED);
}

/* Python (shim.set_listing_inodes): the pusher has started (1) or stopped (0). */
void shardfs_shim_set_listing_inodes(int on)
{
    if (marks != NULL)
        __atomic_store_n(&marks->listing_inodes, on ? 1 : 0, __ATOMIC_RELAXED);
}

/* Python (shim.was_read): has entry i had a READ? */
int shardfs_shim_was_read(uint64_t i)
{
    return i < meta.entries && was_read(i);
}
static init_fn_t real_meta_init;
static lookup_fn_t real_lookup;

/* libfuse3's reply functions, looked up when the session is created (no link-time libfuse3:
 * see _shim.c); the names shadow the declarations of fuse_lowlevel.h on purpose. */
static int (*reply_err)(fuse_req_t, int);
static int (*reply_entry)(fuse_req_t, const struct fuse_entry_param *);
static int (*reply_attr)(fuse_req_t, const struct stat *, double);
static int (*reply_open)(fuse_req_t, const struct fuse_file_info *);
static int (*reply_buf)(fuse_req_t, const char *, size_t);
static void (*reply_none)(fuse_req_t);
static size_t (*add_direntry)(fuse_req_t, char *, size_t, const char *, const struct stat *,
                              off_t);
static size_t (*add_direntry_plus)(fuse_req_t, char *, size_t, const char *,
                                   const struct fuse_entry_param *, off_t);

/* Called from Python before the session is created (shim.serve_metadata). */
int shardfs_shim_serve_metadata(const struct meta_tree *tree, size_t size)
{
    if (tree == NULL || size != sizeof(struct meta_tree))
        return -EINVAL;
    if (marks != NULL)
        munmap(marks, marks_size);
    marks_size = sizeof(struct file_marks) + (size_t)tree->entries;
    marks = mmap(NULL, marks_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (marks == MAP_FAILED)
        marks = NULL;   /* pushes then go by inodes alone, as with plain READDIR */
    free(dirs_asked);
    dirs_asked = calloc(tree->entries, 1);
    meta = *tree;
    meta_ready = 1;
    return 0;
}

/* 1 once the session answers metadata here (Python: shim.metadata_in_c()). */
int shardfs_shim_metadata_installed(void)
{
    return meta_installed;
}

/*
 * FUSE_IOCTL. Python's open() with default buffering asks isatty() (TCGETS) of every file
 * it opens, so each open through the mount in a training loader (torchvision's pil_loader,
 * open(path, "rb")) sends one FUSE_IOCTL, and the kernel never stops sending them (fs/fuse/
 * ioctl.c keeps no "not implemented" flag, unlike OPEN or FLUSH). pyfuse3 has no ioctl
 * handler: libfuse answered ENOSYS (which the kernel turns into ENOTTY), but only after the
 * request had gone back to pyfuse3's loop, ~40-100 us of Python per file. Answered here, in
 * drain_in_c, with ENOTTY, as a file on a local disk answers. Only when the session has no
 * ioctl handler of its own (ioctl_here).
 */
static int ioctl_here;
static uint64_t ioctls_answered;

static void meta_ioctl(fuse_req_t req, fuse_ino_t ino, int cmd, void *arg,
                       struct fuse_file_info *fi, unsigned flags, const void *in_buf,
                       size_t in_bufsz, size_t out_bufsz)
{
    (void)ino, (void)cmd, (void)arg, (void)fi, (void)flags, (void)in_buf, (void)in_bufsz,
        (void)out_bufsz;
    __atomic_add_fetch(&ioctls_answered, 1, __ATOMIC_RELAXED);
    reply_err(req, ENOTTY);
}

/* FUSE_IOCTL requests this process answered (Python: shim.ioctls_answered()). */
uint64_t shardfs_shim_ioctls(void)
{
    return __atomic_load_n(&ioctls_answered, __ATOMIC_RELAXED);
}

static int meta_valid(fuse_ino_t ino)
{
    return ino >= 1 && ino <= meta.entries;
}

/* Position of `i` in an ascending array of n entry positions, or n if absent. */
static uint64_t meta_find(const uint32_t *sorted, uint64_t n, uint64_t i)
{
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < i)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && sorted[lo] == i ? lo : n;
}

static uint64_t meta_link_size(uint64_t i)
{
    uint64_t at = meta_find(meta.link_entry, meta.links, i);
    return at < meta.links ? meta.link_size[at] : 0;
}

/* The same attributes as ShardFS._attr. */
static void meta_stat(uint64_t i, struct stat *st)
{
    memset(st, 0, sizeof(*st));
    st->st_ino = i + 1;
    switch (meta.kind[i]) {
    case KIND_FILE:
        st->st_mode = S_IFREG | 0444 | (meta.mode[i] & 0111);
        st->st_size = (off_t)meta.size[i];
        st->st_blocks = (blkcnt_t)((meta.size[i] + 511) >> 9);
        break;
    case KIND_DIR:
        st->st_mode = S_IFDIR | 0555;
        break;
    default:
        st->st_mode = S_IFLNK | 0777;
        st->st_size = (off_t)meta_link_size(i);
    }
    st->st_nlink = 1;
    st->st_uid = meta.uid;
    st->st_gid = meta.gid;
    st->st_blksize = 1 << 17;
    st->st_mtim.tv_sec = st->st_ctim.tv_sec = st->st_atim.tv_sec = (time_t)meta.mtime[i];
}

static void meta_entry(uint64_t i, struct fuse_entry_param *e)
{
    memset(e, 0, sizeof(*e));
    e->ino = i + 1;
    e->attr_timeout = meta.timeout;
    e->entry_timeout = meta.timeout;
    meta_stat(i, &e->attr);
}

static const char *meta_name(uint64_t i, size_t *len)
{
    uint64_t start = i ? meta.name_end[i - 1] : 0;
    *len = (size_t)(meta.name_end[i] - start);
    return meta.names + start;
}

static void meta_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    if (!meta_valid(parent)) {
        reply_err(req, ENOENT);
        return;
    }
    if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))) {
        real_lookup(req, parent, name);   /* rare (NFS export): Python answers */
        return;
    }
    struct fuse_entry_param e;
    uint64_t p = parent - 1;
    if (meta.kind[p] == KIND_DIR) {
        size_t want = strlen(name);
        uint64_t lo = meta.child_start[p], hi = lo + meta.child_count[p];
        while (lo < hi) {
            uint64_t mid = lo + (hi - lo) / 2;
            uint32_t c = meta.children[mid];
            size_t len;
            const char *have = meta_name(c, &len);
            int cmp = memcmp(have, name, len < want ? len : want);
            if (cmp == 0)
                cmp = len < want ? -1 : len > want ? 1 : 0;
            if (cmp < 0) {
                lo = mid + 1;
            } else if (cmp > 0) {
                hi = mid;
            } else {
                meta_entry(c, &e);
                reply_entry(req, &e);
                return;
            }
        }
    }
    memset(&e, 0, sizeof(e));   /* ino 0: the kernel caches the negative entry */
    e.entry_timeout = meta.timeout;
    reply_entry(req, &e);
}

static void meta_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    if (!meta_valid(ino)) {
        reply_err(req, ENOENT);
        return;
    }
    struct stat st;
    meta_stat(ino - 1, &st);
    reply_attr(req, &st, meta.timeout);
}

static void meta_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (!meta_valid(ino)) {
        reply_err(req, ENOENT);
        return;
    }
    if (meta.kind[ino - 1] != KIND_DIR) {
        reply_err(req, ENOTDIR);
        return;
    }
    fi->fh = ino;
    /* Listings never change: the kernel may keep them in its page cache across opens. */
    fi->cache_readdir = 1;
    fi->keep_cache = 1;
    reply_open(req, fi);
}

static void meta_list(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, int plus)
{
    if (!meta_valid(ino) || meta.kind[ino - 1] != KIND_DIR) {
        reply_err(req, ENOTDIR);
        return;
    }
    static char *name;   /* NUL-terminated copy of one name, grown as needed */
    static size_t name_cap;
    char *buf = malloc(size ? size : 1);
    if (buf == NULL) {
        reply_err(req, ENOMEM);
        return;
    }
    uint64_t p = ino - 1, first = meta.child_start[p], count = meta.child_count[p];
    size_t used = 0;
    int with_inodes = meta.readdirplus != READDIRPLUS_PUSHING
        || (marks != NULL && __atomic_load_n(&marks->listing_inodes, __ATOMIC_RELAXED));
    for (uint64_t pos = off < 0 ? 0 : (uint64_t)off; pos < count; pos++) {
        uint32_t c = meta.children[first + pos];
        size_t len;
        const char *raw = meta_name(c, &len);
        if (len + 1 > name_cap) {
            char *grown = realloc(name, len + 1);
            if (grown == NULL)
                break;
            name = grown;
            name_cap = len + 1;
        }
        memcpy(name, raw, len);
        name[len] = 0;
        size_t n;
        if (plus) {
            struct fuse_entry_param e;
            meta_entry(c, &e);
            if (!with_inodes)
                e.ino = 0;   /* a name, no attributes: the kernel makes no inode for it */
            n = add_direntry_plus(req, buf + used, size - used, name, &e, (off_t)pos + 1);
        } else {
            struct stat st;
            meta_stat(c, &st);
            n = add_direntry(req, buf + used, size - used, name, &st, (off_t)pos + 1);
        }
        if (n > size - used)
            break;
        used += n;
    }
    reply_buf(req, buf, used);
    free(buf);
}

static void meta_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                         struct fuse_file_info *fi)
{
    (void)fi;
    meta_list(req, ino, size, off, 0);
}

static void meta_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                             struct fuse_file_info *fi)
{
    (void)fi;
    meta_list(req, ino, size, off, 1);
}

static void meta_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    reply_err(req, 0);
}

/* Inodes are entry positions and live as long as the mount: lookup counts need no keeping. */
static void meta_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    (void)ino;
    (void)nlookup;
    reply_none(req);
}

static void meta_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
    (void)count;
    (void)forgets;
    reply_none(req);
}

static void meta_init(void *userdata, struct fuse_conn_info *conn)
{
    real_meta_init(userdata, conn);   /* pyfuse3's: READDIRPLUS on, adaptive off */
    if (meta.readdirplus == READDIRPLUS_NEVER)
        conn->want &= ~FUSE_CAP_READDIRPLUS;
    else if (meta.readdirplus == READDIRPLUS_ADAPTIVE
             && (conn->capable & FUSE_CAP_READDIRPLUS_AUTO))
        conn->want |= FUSE_CAP_READDIRPLUS_AUTO;
}

static void meta_install(struct fuse_lowlevel_ops *ops, size_t op_size)
{
    size_t end = offsetof(struct fuse_lowlevel_ops, readdirplus) + sizeof(ops->readdirplus);
    if (!meta_ready || op_size < end || ops->init == NULL || ops->lookup == NULL)
        return;
    reply_err = real("fuse_reply_err");
    reply_entry = real("fuse_reply_entry");
    reply_attr = real("fuse_reply_attr");
    reply_open = real("fuse_reply_open");
    reply_buf = real("fuse_reply_buf");
    reply_none = real("fuse_reply_none");
    add_direntry = real("fuse_add_direntry");
    add_direntry_plus = real("fuse_add_direntry_plus");
    if (!reply_err || !reply_entry || !reply_attr || !reply_open || !reply_buf || !reply_none
        || !add_direntry || !add_direntry_plus)
        return;
    real_meta_init = ops->init;
    real_lookup = ops->lookup;
    ops->init = meta_init;
    ops->lookup = meta_lookup;
    ops->getattr = meta_getattr;
    ops->opendir = meta_opendir;
    ops->readdir = meta_readdir;
    ops->readdirplus = meta_readdirplus;
    ops->releasedir = meta_releasedir;
    ops->forget = meta_forget;
    ops->forget_multi = meta_forget_multi;
    if (ops->ioctl == NULL) {
        ops->ioctl = meta_ioctl;
        ioctl_here = 1;
    }
    meta_installed = 1;
}

/*
 * Reads of cached shard bytes, answered in C (shardfs/fuse/fastread.py sets them up in each
 * process that serves requests). A READ is answered here when the shared shard states say
 * its bytes are on disk (the shard is complete, avail == -2, or a fetch's frontier has passed
 * them, avail >= end), this process holds a descriptor of the shard's cache file opened at
 * the current generation, and the bytes are in the page cache (preadv2 RWF_NOWAIT; on a file
 * system that refuses RWF_NOWAIT, a plain pread where its files are held in memory, tmpfs,
 * and where not, overlayfs, one after mincore over a mapping of the file says the bytes are
 * there: read/diskread.py's read modes). Anything
 * else (bytes not fetched yet, a sparse file, bytes on disk but not in memory) goes to
 * Python's read, which applies the policy. Reads answered here are counted per shard; Python
 * collects the counts for the LRU order, the working set and the stats. Reads of members
 * the lookahead holds in its shared arena are answered here too (_shim_arena.c).
 */
#include <sys/uio.h>
#include <unistd.h>

#define SHARD_COMPLETE (-2)

/* Mirrors shim.py's FastReadArrays (ctypes.Structure): keep both in step. */
struct fast_arrays {
    const int64_t *avail;   /* ShardStates.avail, shared by every process of the mount */
    const int64_t *gen;     /* ShardStates.gen: bumped when a shard's files go away */
    int32_t *fds;           /* this process's descriptor of each shard's file, or -1 */
    const int64_t *fd_gen;  /* the generation each descriptor was opened at */
    uint32_t *complete;     /* reads answered here from complete shards, since collected */
    uint32_t *frontier;     /* ... from below a fetch's frontier */
    uint64_t *bytes;        /* bytes answered here, since collected */
    const uint8_t *mode;    /* how a read of the descriptor's file finds whether its bytes
                               are in memory: READ_NOWAIT, READ_PLAIN or READ_MINCORE */
    const uint64_t *maps;   /* READ_MINCORE: where the file is mapped (PROT_READ; only
                               mincore looks at it, nothing is read from it), or 0 */
    const uint64_t *map_len; /* and the mapping's length */
    uint64_t shards;
    uint32_t *touched;      /* shards whose counts went from 0 since collected, in order */
    uint32_t *touched_len;  /* [0]: entries of `touched` used; [1]: set when it was full */
};

static struct fast_arrays fast;
static int32_t *fast_fds;   /* non-NULL once reads are answered here */

/* Mirrors read/diskread.py's READ_* modes. */
enum { READ_NOWAIT, READ_PLAIN, READ_MINCORE };

/* Whether the mapped file's page cache holds bytes [at, at + n): mincore over the mapping
 * (which asks the page cache and never faults a page in, so a file cut short since it was
 * mapped answers "not there", never SIGBUS). Reads longer than 1 MiB are not asked about. */
static int resident(uint32_t s, uint64_t at, size_t n)
{
    static long page;
    unsigned char vec[260];
    if (page == 0)
        page = sysconf(_SC_PAGESIZE);
    uint64_t base = fast.maps[s];
    if (base == 0 || at + n > fast.map_len[s])
        return 0;
    uint64_t first = at / (uint64_t)page, last = (at + n + (uint64_t)page - 1) / (uint64_t)page;
    if (last - first > sizeof vec)
        return 0;
    if (mincore((void *)(uintptr_t)(base + first * (uint64_t)page),
                (size_t)((last - first) * (uint64_t)page), vec) != 0)
        return 0;
    for (uint64_t k = 0; k < last - first; k++)
        if (!(vec[k] & 1))
            return 0;
    return 1;
}

int shardfs_shim_serve_reads(const struct fast_arrays *arrays, size_t size)
{
    if (!meta_installed || arrays == NULL || size != sizeof(struct fast_arrays))
        return -EINVAL;
    fast = *arrays;
    fast_fds = fast.fds;
    return 0;
}

/* A read whose bytes were read before libfuse dispatched it (see drain_in_c); per thread, as
 * the reader thread's (_shim_reader.c) and pyfuse3's both answer READs. */
static __thread struct {
    int ready;
    fuse_ino_t ino;
    off_t off;
    size_t size, n;
    uint32_t shard;
    int from;
} pre;

#include "_shim_arena.c"

/* Where a read answered here came from (counted apart: see fast_reply). */
enum { FROM_COMPLETE, FROM_FRONTIER, FROM_ARENA };

/* Read a READ's bytes into `fast_buf`: from the lookahead's arena (_shim_arena.c) when it
 * holds the member (first: a member read there is let go at once, where one read from disk
 * held the arena's room until its shard's commit), else from the shard's cache file
 * (complete, or below the frontier of its fetch, held open here, the bytes in the page cache:
 * RWF_NOWAIT). The byte count, or -1 when Python must answer (a sparse or compressed file,
 * bytes neither in the arena nor on disk in memory). */
static __thread char *fast_buf;
static ssize_t fast_prepare(fuse_ino_t ino, size_t size, off_t off, uint32_t *shard,
                            int *from)
{
    static __thread size_t cap;
    if (fast_fds == NULL || !meta_valid(ino) || off < 0)
        return -1;
    uint64_t i = ino - 1;
    if (meta.kind[i] != KIND_FILE)
        return -1;
    if (meta.sparse && meta_find(meta.sparse_entry, meta.sparse, i) < meta.sparse)
        return -1;
    uint32_t s = meta.shard[i];
    if (s >= fast.shards)
        return -1;
    uint64_t member = meta.size[i];
    size_t n = (uint64_t)off >= member ? 0 : size;
    if (n > member - (uint64_t)off)
        n = (size_t)(member - (uint64_t)off);
    if (n > cap) {
        char *grown = realloc(fast_buf, n);
        if (grown == NULL)
            return -1;
        fast_buf = grown;
        cap = n;
    }
    *shard = s;
    if (arena_copy(s, meta.offset[i], (uint64_t)off, n, fast_buf)) {
        *from = FROM_ARENA;
        return (ssize_t)n;
    }
    if (fast_fds[s] >= 0) {
        /* avail before gen: a writer bumps gen before it announces bytes of a new file. */
        int64_t avail = __atomic_load_n(&fast.avail[s], __ATOMIC_ACQUIRE);
        int complete = avail == SHARD_COMPLETE;
        if ((complete || (avail >= 0 && meta.offset[i] + (uint64_t)off + n <= (uint64_t)avail))
            && __atomic_load_n(&fast.gen[s], __ATOMIC_ACQUIRE) == fast.fd_gen[s]) {
            /* (else our descriptor names a file that has gone since) */
            struct iovec iov = {fast_buf, n};
            uint64_t at = meta.offset[i] + (uint64_t)off;
            int mode = fast.mode[s];
            if (n == 0 || ((mode != READ_MINCORE || resident(s, at, n))
                           && preadv2(fast_fds[s], &iov, 1, (off_t)at,
                                      mode == READ_NOWAIT ? RWF_NOWAIT : 0) == (ssize_t)n)) {
                *from = complete ? FROM_COMPLETE : FROM_FRONTIER;
                return (ssize_t)n;
            }
        }
    }
    return -1;
}

static void fast_reply(fuse_req_t req, uint32_t shard, size_t n, int from)
{
    reply_buf(req, fast_buf, n);
    if (from == FROM_ARENA)
        return;   /* recorded in arena_taken, which Python reports as its own reads */
    /* The collection visits only these (fastread.py), not every shard with a descriptor:
     * with thousands of shards open that loop held this lock for ~0.2 ms every 10 ms. */
    if (fast.complete[shard] == 0 && fast.frontier[shard] == 0) {
        if (fast.touched_len[0] < fast.shards)
            fast.touched[fast.touched_len[0]++] = shard;
        else
            fast.touched_len[1] = 1;
    }
    (from == FROM_FRONTIER ? fast.frontier : fast.complete)[shard]++;
    *fast.bytes += n;
}

/* 1 if answered here, 0 if Python must answer. */
static int fast_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off)
{
    if (pre.ready) {
        pre.ready = 0;
        if (pre.ino == ino && pre.off == off && pre.size == size) {
            fast_reply(req, pre.shard, pre.n, pre.from);
            return 1;
        }
    }
    uint32_t shard;
    int from;
    ssize_t n = fast_prepare(ino, size, off, &shard, &from);
    if (n < 0)
        return 0;
    fast_reply(req, shard, (size_t)n, from);
    return 1;
}

/*
 * Requests answered in C still cost a wake-up of pyfuse3's loop each (a trio lock and a
 * wait for readability, tens of microseconds of Python) where the reader thread
 * (_shim_reader.c) does not read them: it answers them with drain_in_c too. Without it, after
 * receiving a request, the
 * wrapper of fuse_session_receive_buf answers it right there if it is one of ours and the
 * next one is already waiting, and goes on until the queue is empty (pyfuse3 waits again)
 * or a request needs Python (handed to pyfuse3 as if just received).
 */
#include <linux/fuse.h>
#include <poll.h>

static int drain_in_c(struct fuse_session *se, struct fuse_buf *buf, int len,
                      process_buf_fn process)
{
    if (!meta_installed || (buf->flags & FUSE_BUF_IS_FD)
        || (size_t)len < sizeof(struct fuse_in_header))
        return 0;
    const struct fuse_in_header *in = buf->mem;
    switch (in->opcode) {
    case FUSE_LOOKUP: {
        const char *name = (const char *)(in + 1);
        size_t room = (size_t)len - sizeof(*in);
        if (room < 2 || (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && room > 2
                                                           && name[2] == 0))))
            return 0;   /* "." and "..": Python */
        break;
    }
    case FUSE_GETATTR:
    case FUSE_OPENDIR:
    case FUSE_READDIR:
    case FUSE_READDIRPLUS:
    case FUSE_RELEASEDIR:
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
        break;
    case FUSE_IOCTL:
        if (!ioctl_here)
            return 0;
        break;
    case FUSE_READ: {
        if ((size_t)len < sizeof(*in) + sizeof(struct fuse_read_in))
            return 0;
        const struct fuse_read_in *arg = (const void *)(in + 1);
        uint32_t shard;
        int from;
        ssize_t n = fast_prepare(in->nodeid, arg->size, (off_t)arg->offset, &shard, &from);
        if (n < 0)
            return 0;
        pre.from = from;
        pre.ready = 1;
        pre.ino = in->nodeid;
        pre.off = (off_t)arg->offset;
        pre.size = arg->size;
        pre.n = (size_t)n;
        pre.shard = shard;
        break;
    }
    default:
        return 0;
    }
    process(se, buf);
    pre.ready = 0;
    return 1;
}

static int readable_now(int fd)
{
    struct pollfd p = {fd, POLLIN, 0};
    return poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}

/*
 * Page push in C (shardfs/fuse/pagepush.py): one shard's files, from its cache file into the
 * kernel's page cache (FUSE_NOTIFY_STORE), in a thread that does not hold the GIL (ctypes
 * releases it around this call). The same steps as the Python loop it replaces, per file:
 * a file some process of the mount had a READ of already (marks, above) is not pushed; a
 * file is stored at once where the kernel has its inode, and its store fails with ENOENT,
 * storing nothing, where it has none (nobody looked it up or listed it with attributes;
 * without marks a zero-length store asks first, as an inode then means a reader looked it
 * up); a file without one is looked up by a stat through the mount, made by the lookup
 * process (shardfs/fuse/lookupproc.py: never by this process, which may be the one to answer
 * it), then stored. The bytes are read from the cache file PUSH_WINDOW at a time (the next
 * files with them: one pread for ~10 files of ~24 KiB, not one each), a larger file in pieces
 * of at most PUSH_PIECE bytes. The lookups go in batches of up to PUSH_BATCH paths: the
 * process looks the next files up while this thread stores.
 * No Python object per file: in Python this loop held the GIL for ~6-8 us per file, beside
 * the loop thread that answers FUSE requests (bench cpusplit).
 */
#include <dirent.h>
#include <sys/socket.h>
#include <unistd.h>

#define PUSH_BATCH 64
#define PUSH_PATHS (32u << 10)   /* a batch's paths, at most */

#define PUSH_PIECE (4u << 20)
#define PUSH_WINDOW (256u << 10)   /* read from the cache file at once, for the next files */

/* push_file's answers besides 0 (stored) and -errno */
enum { PUSH_SKIPPED = 1, PUSH_NO_INODE = 2 };

/* The cache file's bytes [start, start + len) in buf, read for the files that follow;
 * `end`: where the shard's last plain file ends (no read goes past it). */
struct push_read {
    char *buf;
    size_t cap, len;
    uint64_t start, end;
};

/* Mirrors pagepush.py's PushCounts (ctypes.Structure): keep both in step. */
struct push_counts {
    uint64_t looked_up, files, bytes, opened, unknown, errors;
    uint64_t listed;   /* of `files`: pushed without a lookup (the kernel had the inode) */
    uint64_t dirs_listed;   /* directories the lookup process listed for the push */
    int32_t off;       /* set when the kernel takes no pushed pages (ENOSYS) */
    int32_t error;     /* the errno that stopped the push (0: none) */
    int32_t stop;      /* set by Python (the mount is going away): stop after this file */
    int32_t unused;
};

static struct fuse_session *last_session;   /* defined in _shim.c */

typedef int (*notify_store_fn)(struct fuse_session *, fuse_ino_t, off_t, struct fuse_bufvec *,
                               enum fuse_buf_copy_flags);

static int push_store(notify_store_fn store, fuse_ino_t ino, off_t at, const char *data,
                      size_t n)
{
    struct fuse_bufvec bufv = FUSE_BUFVEC_INIT(n);
    bufv.buf[0].mem = (void *)data;
    return store(last_session, ino, at, &bufv, 0);
}

/* The path of entry i through the mount, built from its end in `path`: where it starts, or
 * NULL if it does not fit. */
static const char *push_path(const uint32_t *parent, uint64_t i, const char *mountpoint,
                             char *path, size_t cap)
{
    size_t base = strlen(mountpoint), at = cap - 1;
    path[at] = 0;
    for (uint64_t e = i; e != 0; e = parent[e]) {   /* entry 0 is the root */
        size_t len;
        const char *name = meta_name(e, &len);
        if (len + 1 + base > at)
            return NULL;
        at -= len;
        memcpy(path + at, name, len);
        path[--at] = '/';
    }
    at -= base;
    memcpy(path + at, mountpoint, base);
    return path + at;
}

/* Directory entry d's path through the mount with a '/' at its end (a listing, in the lookup
 * process's protocol below), or NULL if it does not fit. */
static const char *push_dir_path(const uint32_t *parent, uint64_t d, const char *mountpoint,
                                 char *path, size_t cap)
{
    const char *where = push_path(parent, d, mountpoint, path, cap - 1);
    if (where != NULL) {
        path[cap - 2] = '/';
        path[cap - 1] = 0;
    }
    return where;
}

/* Do listings give the kernel inodes now (READDIRPLUS entries with attributes)? */
static int listings_give_inodes(void)
{
    return meta.readdirplus == READDIRPLUS_ALWAYS
        || (meta.readdirplus == READDIRPLUS_PUSHING && marks != NULL
            && __atomic_load_n(&marks->listing_inodes, __ATOMIC_RELAXED));
}

/* Python (shim.listings_give_inodes). */
int shardfs_shim_listings_give_inodes(void)
{
    return listings_give_inodes();
}

/* The lookup process's protocol (lookupproc.py): paths out, each ended by a NUL; one byte
 * per path back, 'y' or 'n'. A path ending in '/' is a directory to list (every entry read:
 * while pages are pushed, a listing gives the kernel every listed file's inode). */
static int lookup_send(int sock, const char *data, size_t n)
{
    while (n > 0) {
        ssize_t put = send(sock, data, n, MSG_NOSIGNAL);
        if (put < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        data += put;
        n -= (size_t)put;
    }
    return 0;
}

/* Wait until answers[0..want) are all in (`*have` of them read so far). 0 or -errno (-EPIPE:
 * the process ended). */
static int lookup_await(int sock, char *answers, size_t *have, size_t want)
{
    while (*have < want) {
        ssize_t got = read(sock, answers + *have, want - *have);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return got == 0 ? -EPIPE : -errno;
        *have += (size_t)got;
    }
    return 0;
}

/* One path of the protocol: a stat, or (a path ending in '/') a whole listing. 0 or -1. */
static int lookup_one(const char *path, size_t len)
{
    if (len == 0 || path[len - 1] != '/') {
        struct stat st;
        return stat(path, &st);
    }
    DIR *dir = opendir(path);
    if (dir == NULL)
        return -1;
    errno = 0;
    while (readdir(dir) != NULL)
        ;
    int failed = errno != 0;
    closedir(dir);
    return failed ? -1 : 0;
}

/* The lookup process's side (lookupproc.py calls it; it runs in that process, not in one that
 * serves the mount): stat each path read from `sock`, answer 'y' or 'n' per path in order,
 * until end of file. 0, or -errno. */
int shardfs_shim_lookup_serve(int sock)
{
    enum { BUF = 64 << 10 };
    char *buf = malloc(BUF), *answers = malloc(BUF);
    size_t have = 0;
    int res = 0;
    if (buf == NULL || answers == NULL) {
        res = -ENOMEM;
        goto out;
    }
    for (;;) {
        ssize_t got = read(sock, buf + have, BUF - have);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            res = got == 0 ? 0 : -errno;   /* end of file: the daemon closed it, or died */
            break;
        }
        have += (size_t)got;
        size_t at = 0, n = 0;
        for (char *end; (end = memchr(buf + at, 0, have - at)) != NULL;
             at = (size_t)(end - buf) + 1) {
            answers[n++] = lookup_one(buf + at, (size_t)(end - buf) - at) == 0 ? 'y' : 'n';
        }
        if (n > 0 && (res = lookup_send(sock, answers, n)) != 0)
            break;
        if (at == 0 && have == BUF) {
            res = -ENAMETOOLONG;   /* not the pusher's protocol */
            break;
        }
        memmove(buf, buf + at, have - at);
        have -= at;
    }
out:
    free(buf);
    free(answers);
    return res;
}

/* Have the lookup process list directory entry d (the kernel makes the inodes the listing
 * gives). 0, also when the listing failed or the path does not fit (the files are then
 * looked up one by one), or -errno when the process is gone. */
static int list_dir(int lookup, const uint32_t *parent, uint64_t d, const char *mountpoint,
                    char *path, size_t cap, struct push_counts *counts)
{
    const char *where = push_dir_path(parent, d, mountpoint, path, cap);
    if (where == NULL)
        return 0;
    int r = lookup_send(lookup, where, strlen(where) + 1);
    char answer;
    size_t have = 0;
    if (r == 0)
        r = lookup_await(lookup, &answer, &have, 1);
    if (r == 0 && answer == 'y')
        counts->dirs_listed++;
    return r;
}

static int push_grow(struct push_read *rd, size_t want)
{
    if (want <= rd->cap)
        return 0;
    char *grown = realloc(rd->buf, want);
    if (grown == NULL)
        return -ENOMEM;
    rd->buf = grown;
    rd->cap = want;
    return 0;
}

/* Store file i from `fd` (its cache file). 0 when stored (counted); PUSH_NO_INODE when its
 * first store found no inode for it (nothing stored, nothing counted); PUSH_SKIPPED when
 * not stored for another reason (counted); or -errno that stops the push. */
static int push_file(notify_store_fn store, int fd, uint64_t i, struct push_read *rd,
                     struct push_counts *counts)
{
    uint64_t size = meta.size[i], offset = meta.offset[i];
    for (uint64_t at = 0; at < size;) {
        const char *data;
        size_t piece;
        if (size <= PUSH_WINDOW) {   /* the whole file, from the window read for it */
            if (offset < rd->start || offset + size > rd->start + rd->len) {
                uint64_t want = rd->end - offset < PUSH_WINDOW ? rd->end - offset : PUSH_WINDOW;
                int r = push_grow(rd, PUSH_WINDOW);
                if (r != 0)
                    return r;
                ssize_t got = pread(fd, rd->buf, (size_t)want, (off_t)offset);
                rd->start = offset;
                rd->len = got < 0 ? 0 : (size_t)got;
                if (got < (ssize_t)size)
                    return got < 0 ? -errno : -EIO;   /* a short read of a cached shard */
            }
            data = rd->buf + (offset - rd->start);
            piece = (size_t)size;
        } else {   /* piece by piece: the window's bytes go */
            piece = size - at < PUSH_PIECE ? (size_t)(size - at) : PUSH_PIECE;
            int r = push_grow(rd, piece);
            if (r != 0)
                return r;
            rd->len = 0;
            ssize_t got = pread(fd, rd->buf, piece, (off_t)(offset + at));
            if (got != (ssize_t)piece)
                return got < 0 ? -errno : -EIO;   /* a short read of a cached shard */
            data = rd->buf;
        }
        int r = push_store(store, i + 1, (off_t)at, data, piece);
        if (r == -ENOSYS) {
            counts->off = 1;
            return PUSH_SKIPPED;
        }
        if (r == -ENOENT && at == 0)
            return PUSH_NO_INODE;
        if (r == -ENOENT) {
            counts->unknown++;   /* its inode went away meanwhile */
            return PUSH_SKIPPED;
        }
        if (r != 0)
            return r;
        at += piece;
    }
    counts->files++;
    counts->bytes += size;
    return 0;
}

/* Push the files at entry positions entries[0..n) (plain files of one shard, in offset
 * order) from `fd`, the shard's cache file, looking files up through `lookup` (the lookup
 * process's socket). 0, or -errno when it stopped early (the mount going away, the cache
 * file unreadable, the lookup process gone); counts are added to `counts` either way. */
int shardfs_shim_push(int fd, int lookup, const uint32_t *entries, uint64_t n,
                      const uint32_t *parent, const char *mountpoint,
                      struct push_counts *counts, size_t counts_size)
{
    if (!meta_ready || last_session == NULL || counts == NULL
        || counts_size != sizeof(struct push_counts))
        return -EINVAL;
    static notify_store_fn store;
    if (store == NULL)
        store = (notify_store_fn)real("fuse_lowlevel_notify_store");
    if (store == NULL)
        return -ENOSYS;
    char path[8192];
    char *paths = malloc(PUSH_PATHS);
    if (paths == NULL)
        return -ENOMEM;
    struct push_read rd = {NULL, 0, 0, 0, 0};
    for (uint64_t k = 0; k < n; k++) {   /* where the shard's last file ends */
        uint64_t i = entries[k];
        if (meta.offset[i] + meta.size[i] > rd.end)
            rd.end = meta.offset[i] + meta.size[i];
    }
    int res = 0;
    uint64_t k = 0;
    while (k < n && res == 0 && !counts->off
           && !__atomic_load_n(&counts->stop, __ATOMIC_RELAXED)) {
        /* The next files the kernel has no inode for, their paths to the lookup process. */
        uint32_t wanted[PUSH_BATCH];
        size_t asked = 0, used = 0;
        for (; k < n && asked < PUSH_BATCH; k++) {
            uint64_t i = entries[k];
            if (meta.size[i] == 0)
                continue;
            if (was_read(i)) {
                counts->opened++;
                continue;
            }
            int r;
            if (marks == NULL) {   /* asked first: an inode means a reader looked it up */
                r = push_store(store, i + 1, 0, "", 0);
                if (r == 0) {
                    counts->opened++;
                    continue;
                }
                if (r == -ENOSYS)
                    counts->off = 1;
                else if (r != -ENOENT)
                    res = r;
                if (r != -ENOENT)
                    break;
                r = PUSH_NO_INODE;
            } else {
                r = push_file(store, fd, i, &rd, counts);
            }
            if (r == PUSH_NO_INODE && dirs_asked != NULL && !dirs_asked[parent[i]]
                && listings_give_inodes()) {
                /* Its directory listed once, by the lookup process: one request per reply
                 * of ~300 entries gives their inodes, instead of a stat per file. */
                dirs_asked[parent[i]] = 1;
                if ((r = list_dir(lookup, parent, parent[i], mountpoint, path, sizeof(path),
                                  counts)) != 0) {
                    res = r;
                    break;
                }
                r = push_file(store, fd, i, &rd, counts);
            }
            if (r != PUSH_NO_INODE) {   /* listed (or looked up, not read yet): no lookup */
                counts->listed += r == 0;
                if (r < 0)
                    res = r;
                if (r < 0 || counts->off || __atomic_load_n(&counts->stop, __ATOMIC_RELAXED))
                    break;
                continue;
            }
            const char *where = push_path(parent, i, mountpoint, path, sizeof(path));
            size_t len = where == NULL ? 0 : strlen(where) + 1;
            if (where == NULL || len > PUSH_PATHS) {
                counts->unknown++;
                continue;
            }
            if (used + len > PUSH_PATHS)
                break;   /* the next batch's first (its inode asked about again: harmless) */
            memcpy(paths + used, where, len);
            used += len;
            wanted[asked++] = (uint32_t)i;
        }
        if (asked == 0)
            continue;
        int r = lookup_send(lookup, paths, used);
        if (r != 0) {
            res = r;
            break;
        }
        /* Each file's pages once its answer is in; every answer is read, so the next push
         * starts in step with the process. */
        char answers[PUSH_BATCH];
        size_t have = 0;
        for (size_t j = 0; j < asked; j++) {
            r = lookup_await(lookup, answers, &have, j + 1);
            if (r != 0) {
                res = r;
                break;
            }
            if (res != 0 || counts->off || __atomic_load_n(&counts->stop, __ATOMIC_RELAXED))
                continue;
            if (answers[j] != 'y') {
                counts->unknown++;
                continue;
            }
            counts->looked_up++;
            r = push_file(store, fd, wanted[j], &rd, counts);
            if (r == PUSH_NO_INODE)
                counts->unknown++;   /* its inode went away meanwhile */
            if (r < 0)
                res = r;
        }
    }
    free(rd.buf);
    free(paths);
    if (res != 0) {
        counts->errors++;
        counts->error = -res;
    }
    return res;
}
