/*
 * shardfs's shim between pyfuse3 and libfuse3 (our code; see docs/pyfuse3.md).
 *
 * Loaded with RTLD_GLOBAL before pyfuse3 is imported, so that pyfuse3's references to the
 * functions below bind here; each one forwards to the real libfuse3 function.
 *
 * 1. fuse_session_new: wraps the READ callback. When the filesystem answers OPEN with ENOSYS
 *    the kernel stops sending OPEN/RELEASE and every READ arrives with fh == 0; pyfuse3 passes
 *    only fi->fh to Operations.read, so the wrapper copies the inode into fi->fh first.
 * 2. fuse_session_receive_buf: several processes may read one FUSE connection (cloned
 *    /dev/fuse fds). A non-blocking fd then answers EAGAIN when another process took the
 *    request first; pyfuse3 would raise, so EAGAIN is reported as EINTR, which pyfuse3 treats
 *    as "nothing to do, wait again".
 * 3. shardfs_shim_process_one: receives and processes one request synchronously (used to
 *    answer INIT before worker processes are forked). Call it holding the GIL (ctypes.PyDLL):
 *    pyfuse3's callbacks expect it.
 * 4. Metadata in C (_shim_meta.c, included below): when shardfs_shim_serve_metadata() was given
 *    the tree's arrays before the session is created, LOOKUP, GETATTR, OPENDIR, READDIR,
 *    READDIRPLUS, RELEASEDIR and FORGET are answered here from those (immutable) arrays,
 *    without entering Python, and so are READs of shard bytes on disk (complete, or below a
 *    fetch's frontier) that are in the page cache (shardfs_shim_serve_reads); everything
 *    else still goes to pyfuse3.
 * 5. Takeover (docs/pyfuse3.md, "A session that outlives its daemon"): the kernel's INIT request
 *    is kept as received (shardfs_shim_init_request), so that the daemon can record it; a new
 *    daemon adopting the live connection feeds that request to libfuse again through
 *    fuse_session_process_buf (shardfs_shim_replay_init) while the session's descriptor is
 *    still a pipe, which takes libfuse through its own INIT handling (got_init, the
 *    negotiated protocol minor, capabilities, max_write) and catches the reply, which the
 *    kernel must not see twice. Only public libfuse API is used.
 *
 * 6. The reader thread (_shim_reader.c, included below): a thread of C reads /dev/fuse,
 *    answers what item 4 answers without waking pyfuse3's loop, and hands it the rest
 *    (fuse_session_fd gives pyfuse3 an eventfd to wait on).
 *
 * No libfuse3 link at build time: the real functions are looked up in the already loaded
 * libfuse3 (pyfuse3 loaded it) on first use.
 */
#define FUSE_USE_VERSION 31
#define PY_SSIZE_T_CLEAN
#include <Python.h>   /* first (it sets _GNU_SOURCE): the GIL is let go while lingering */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <fuse_lowlevel.h>

typedef struct fuse_session *(*session_new_fn)(struct fuse_args *, const struct fuse_lowlevel_ops *,
                                               size_t, void *);
typedef int (*receive_buf_fn)(struct fuse_session *, struct fuse_buf *);
typedef void (*process_buf_fn)(struct fuse_session *, const struct fuse_buf *);
typedef void (*read_fn)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);

static read_fn real_read;
static void *real(const char *name);
static int fast_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off);
#include "_shim_meta.c"

/* The kernel's INIT request as received (fuse_in_header + fuse_init_in), for the record. */
static unsigned char init_request[sizeof(struct fuse_in_header) + sizeof(struct fuse_init_in)];
static size_t init_request_len;

static void note_init(const struct fuse_buf *buf, int len)
{
    if (len < (int)sizeof(struct fuse_in_header) || (buf->flags & FUSE_BUF_IS_FD)
        || buf->mem == NULL)
        return;
    const struct fuse_in_header *in = buf->mem;
    if (in->opcode != FUSE_INIT)
        return;
    size_t n = (size_t)len < sizeof(init_request) ? (size_t)len : sizeof(init_request);
    memset(init_request, 0, sizeof(init_request));
    memcpy(init_request, buf->mem, n);
    init_request_len = n;
}

static void *patched_ops;          /* our copy of the caller's ops, READ replaced */
static struct fuse_session *last_session;
static int sessions_patched;

#include "_shim_reader.c"

static void *real(const char *name)
{
    static void *libfuse;
    if (libfuse == NULL)
        libfuse = dlopen("libfuse3.so.3", RTLD_NOW | RTLD_NOLOAD);
    if (libfuse == NULL)
        return NULL;
    void *fn = dlvsym(libfuse, name, "FUSE_3.0");
    return fn != NULL ? fn : dlsym(libfuse, name);
}

static void read_with_inode(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                            struct fuse_file_info *fi)
{
    if (fi != NULL && fi->fh == 0)
        fi->fh = ino;
    mark_read(ino);   /* the page push leaves this file alone from now on */
    int answered;
    if (serving) {   /* from drain_serving, which holds serve_mu */
        answered = fast_read(req, ino, size, off);
    } else {
        pthread_mutex_lock(&serve_mu);
        answered = fast_read(req, ino, size, off);
        pthread_mutex_unlock(&serve_mu);
    }
    if (!answered)
        real_read(req, ino, size, off, fi);
}

struct fuse_session *fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op,
                                      size_t op_size, void *userdata)
{
    session_new_fn next = (session_new_fn)real("fuse_session_new");
    if (next == NULL)
        return NULL;
    size_t read_end = offsetof(struct fuse_lowlevel_ops, read) + sizeof(read_fn);
    if (op == NULL || op_size < read_end || op->read == NULL)
        return next(args, op, op_size, userdata);
    void *copy = malloc(op_size);
    if (copy == NULL)
        return next(args, op, op_size, userdata);
    memcpy(copy, op, op_size);
    real_read = op->read;
    ((struct fuse_lowlevel_ops *)copy)->read = read_with_inode;
    meta_install(copy, op_size);
    struct fuse_session *se = next(args, copy, op_size, userdata);
    if (se != NULL) {
        free(patched_ops);   /* libfuse copied the ops into the session */
        patched_ops = copy;
        last_session = se;
        sessions_patched++;
    } else {
        free(copy);
    }
    return se;
}

/*
 * Lingering: once the queue is empty after requests answered here, wait up to linger_ns
 * more for the next one (the GIL let go) before going back to pyfuse3's loop. Each return
 * to that loop costs its wait for readability again: trio's epoll and task switch, tens of
 * microseconds of Python per wake-up, in the one thread that serves every request (bench
 * cpusplit). With readers busy, the next request comes within microseconds. At most
 * LINGER_BUDGET_NS in all per receive, so the loop's other tasks (fetches, Python reads)
 * wait no longer than that. 0 (shim.set_linger; the default, see shim.py): never.
 */
#include <time.h>

#define LINGER_BUDGET_NS 1000000ull

static uint64_t linger_ns;

void shardfs_shim_set_linger(uint64_t ns)
{
    linger_ns = ns < LINGER_BUDGET_NS ? ns : LINGER_BUDGET_NS;
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* 1 if a request is waiting after at most linger_ns (and the budget since `*began` is not
 * spent), else 0. */
static int linger(int fd, uint64_t *began)
{
    if (linger_ns == 0)
        return 0;
    uint64_t now = now_ns();
    if (*began == 0)
        *began = now;
    else if (now - *began >= LINGER_BUDGET_NS)
        return 0;
    struct pollfd p = {fd, POLLIN, 0};
    struct timespec wait = {0, (long)linger_ns};
    int held = PyGILState_Check();
    PyThreadState *state = held ? PyEval_SaveThread() : NULL;
    int ready = ppoll(&p, 1, &wait, NULL);
    if (held)
        PyEval_RestoreThread(state);
    return ready == 1 && (p.revents & POLLIN);
}

int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf)
{
    static receive_buf_fn next;
    static process_buf_fn process;
    typedef int (*fd_fn)(struct fuse_session *);
    static fd_fn session_fd;
    if (next == NULL) {
        next = (receive_buf_fn)real("fuse_session_receive_buf");
        process = (process_buf_fn)real("fuse_session_process_buf");
        session_fd = (fd_fn)real("fuse_session_fd");
    }
    if (next == NULL)
        return -ENOSYS;
    if (reader_running && se == last_session)
        return handed_request(buf);   /* the reader thread receives (_shim_reader.c) */
    int res = next(se, buf);
    if (res > 0 && init_request_len == 0)
        note_init(buf, res);
    /* Answer what C can answer without going back to pyfuse3's loop (_shim_meta.c). */
    uint64_t began = 0;
    while (res > 0 && process != NULL && session_fd != NULL
           && drain_serving(se, buf, res, process)) {
        if (!readable_now(session_fd(se)) && !linger(session_fd(se), &began))
            return -EINTR;   /* pyfuse3: nothing to do, wait again */
        res = next(se, buf);
    }
    return res == -EAGAIN ? -EINTR : res;
}

/* How many sessions were created through the wrapper: 0 means the shim is not in effect. */
int shardfs_shim_sessions(void)
{
    return sessions_patched;
}

/* The /dev/fuse descriptor of the last session (-1 if none). */
int shardfs_shim_session_fd(void)
{
    typedef int (*fd_fn)(struct fuse_session *);
    fd_fn session_fd = (fd_fn)real("fuse_session_fd");
    return last_session != NULL && session_fd != NULL ? session_fd(last_session) : -1;
}

/* Receive and process one request of the last session; returns receive_buf's result. */
int shardfs_shim_process_one(void)
{
    if (last_session == NULL)
        return -ENOTCONN;
    receive_buf_fn receive = (receive_buf_fn)real("fuse_session_receive_buf");
    process_buf_fn process = (process_buf_fn)real("fuse_session_process_buf");
    if (receive == NULL || process == NULL)
        return -ENOSYS;
    struct fuse_buf buf;
    memset(&buf, 0, sizeof(buf));
    int res;
    do {
        res = receive(last_session, &buf);
    } while (res == -EINTR);
    if (res > 0) {
        note_init(&buf, res);
        process(last_session, &buf);
    }
    free(buf.mem);
    return res;
}

/* Copy the kernel's INIT request (as received by this process) into out; its length, or 0 if
 * none was received here, or -1 if out is too small. */
int shardfs_shim_init_request(unsigned char *out, size_t room)
{
    if (init_request_len == 0)
        return 0;
    if (room < init_request_len)
        return -1;
    memcpy(out, init_request, init_request_len);
    return (int)init_request_len;
}

/* Have libfuse process `request` (a recorded INIT request) as if the kernel had just sent it:
 * the last session becomes initialised exactly as the first daemon's was. The reply goes to
 * the session's current descriptor, which the caller has made a pipe. 0, or -errno. */
int shardfs_shim_replay_init(const unsigned char *request, size_t len)
{
    if (last_session == NULL)
        return -ENOTCONN;
    if (len < sizeof(struct fuse_in_header) + 8
        || ((const struct fuse_in_header *)request)->opcode != FUSE_INIT
        || ((const struct fuse_in_header *)request)->len != len)
        return -EINVAL;
    process_buf_fn process = (process_buf_fn)real("fuse_session_process_buf");
    if (process == NULL)
        return -ENOSYS;
    void *copy = malloc(len);
    if (copy == NULL)
        return -ENOMEM;
    memcpy(copy, request, len);
    struct fuse_buf buf;
    memset(&buf, 0, sizeof(buf));
    buf.mem = copy;
    buf.size = len;
    process(last_session, &buf);
    free(copy);
    memcpy(init_request, request, len);   /* this process's record is the same request */
    init_request_len = len;
    return 0;
}
