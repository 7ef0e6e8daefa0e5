/*
 * The reader thread (part of _shim.c; see docs/pyfuse3.md, "Requests read by a thread of C").
 *
 * Without it, every FUSE request wakes pyfuse3's loop: trio's epoll, a task switch, the
 * shim's receive wrapper — tens of microseconds of Python on the thread that also drives every
 * fetch, even for the requests the shim answers in C (LOOKUP, GETATTR, the IOCTL of open(),
 * READs of cached bytes: nearly all of a cold epoch's). With it, a thread of ours that never
 * takes the GIL reads the session's /dev/fuse descriptor, answers those requests itself
 * (drain_in_c) and hands only the others to pyfuse3: a queue, and an eventfd that pyfuse3's
 * loop waits on in place of the session's descriptor (fuse_session_fd below returns it), so
 * the receive wrapper gives pyfuse3 a request the thread has read as if libfuse had just
 * received it. Replies go straight to the session's descriptor from either thread (libfuse's
 * reply functions are made for several threads: fuse_session_loop_mt).
 *
 * What the C answers read that Python changes (the descriptors and counts of fastread.py, the
 * arena table of arenareads.py) is guarded by `serve_mu`: the thread holds it while it
 * answers a request, Python while it changes or collects those (shim.paused()). The thread
 * never takes the GIL, so Python may wait for the mutex holding it.
 *
 * In each process that serves (the daemon, or each FUSE worker): shardfs_shim_use_reader()
 * before pyfuse3.init() (which asks for the descriptor to wait on), then
 * shardfs_shim_start_reader() before pyfuse3.main() and shardfs_shim_stop_reader() after it.
 * A forked worker inherits the eventfd's number and gets a new eventfd of its own there.
 */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

struct handed {
    struct handed *next;
    int len;      /* > 0: a request of len bytes at data; <= 0: how receiving ended */
    char *data;
};

static int reader_wanted;              /* shardfs_shim_use_reader() was called */
static int hand_fd = -1;               /* what pyfuse3 waits on: an eventfd (a semaphore) */
static int stop_fd = -1;               /* written to stop the thread */
static int reader_running;
static pthread_t reader;
static pthread_mutex_t hand_mu = PTHREAD_MUTEX_INITIALIZER;
static struct handed *hand_head, *hand_tail;
static pthread_mutex_t serve_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int serving;           /* this thread holds serve_mu (see drain_serving) */
static uint64_t reader_answered, reader_handed;

int shardfs_shim_session_fd(void);

/* Ask for the reader thread: from now on pyfuse3 is given the eventfd to wait on. Call
 * before pyfuse3.init(). 0, or -errno. */
int shardfs_shim_use_reader(void)
{
    if (hand_fd < 0)
        hand_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
    if (hand_fd < 0)
        return -errno;
    reader_wanted = 1;
    return 0;
}

/* The descriptor pyfuse3 waits on (kept open across a worker's fork), or -1. */
int shardfs_shim_reader_wait_fd(void)
{
    return reader_wanted ? hand_fd : -1;
}

int fuse_session_fd(struct fuse_session *se)
{
    typedef int (*fd_fn)(struct fuse_session *);
    static fd_fn next;
    if (next == NULL)
        next = (fd_fn)real("fuse_session_fd");
    if (reader_wanted && se == last_session)
        return hand_fd;
    return next != NULL ? next(se) : -1;
}

void shardfs_shim_pause_serving(void)
{
    pthread_mutex_lock(&serve_mu);
}

void shardfs_shim_resume_serving(void)
{
    pthread_mutex_unlock(&serve_mu);
}

/* drain_in_c holding serve_mu (a READ it answers calls read_with_inode, which then does not
 * take the mutex again). */
static int drain_serving(struct fuse_session *se, struct fuse_buf *buf, int len,
                         process_buf_fn process)
{
    pthread_mutex_lock(&serve_mu);
    serving = 1;
    int done = drain_in_c(se, buf, len, process);
    serving = 0;
    pthread_mutex_unlock(&serve_mu);
    return done;
}

static void hand(int len, char *data)
{
    struct handed *h = malloc(sizeof(*h));
    if (h == NULL) {   /* cannot queue it: the kernel resends it if asked (FUSE_NOTIFY_RESEND) */
        free(data);
        return;
    }
    h->next = NULL;
    h->len = len;
    h->data = data;
    pthread_mutex_lock(&hand_mu);
    if (hand_tail != NULL)
        hand_tail->next = h;
    else
        hand_head = h;
    hand_tail = h;
    pthread_mutex_unlock(&hand_mu);
    uint64_t one = 1;
    (void)!write(hand_fd, &one, sizeof(one));
}

static void *reader_main(void *arg)
{
    struct fuse_session *se = arg;
    receive_buf_fn receive = (receive_buf_fn)real("fuse_session_receive_buf");
    process_buf_fn process = (process_buf_fn)real("fuse_session_process_buf");
    int fd = shardfs_shim_session_fd();
    struct fuse_buf buf;
    memset(&buf, 0, sizeof(buf));
    for (;;) {
        /* Wait here, not in read(): a worker's descriptor is non-blocking, and stop_fd. */
        struct pollfd p[2] = {{fd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            hand(-errno, NULL);
            break;
        }
        if (p[1].revents & POLLIN)
            break;
        int res = receive(se, &buf);
        if (res == -EINTR || res == -EAGAIN || res == -ENOENT)
            continue;   /* another worker took it, or it was interrupted */
        if (res <= 0) {   /* 0: unmounted (libfuse marked the session exited) */
            hand(res, NULL);
            break;
        }
        if (init_request_len == 0)
            note_init(&buf, res);
        if (drain_serving(se, &buf, res, process)) {
            __atomic_fetch_add(&reader_answered, 1, __ATOMIC_RELAXED);
            continue;
        }
        char *copy = malloc((size_t)res);
        if (copy == NULL) {
            hand(-ENOMEM, NULL);
            break;
        }
        memcpy(copy, buf.mem, (size_t)res);
        __atomic_fetch_add(&reader_handed, 1, __ATOMIC_RELAXED);
        hand(res, copy);
    }
    free(buf.mem);
    return NULL;
}

/* The receive wrapper's part while the thread runs: the next request it handed over, as if
 * just received (-EINTR: none yet, wait again; <= 0 as the thread's receive ended it). */
static int handed_request(struct fuse_buf *buf)
{
    uint64_t one;
    if (read(hand_fd, &one, sizeof(one)) != sizeof(one))
        return -EINTR;
    pthread_mutex_lock(&hand_mu);
    struct handed *h = hand_head;
    if (h != NULL && h->len > 0) {
        hand_head = h->next;
        if (hand_head == NULL)
            hand_tail = NULL;
    }
    pthread_mutex_unlock(&hand_mu);
    if (h == NULL)
        return -EINTR;
    if (h->len <= 0) {   /* the end stays queued and the eventfd readable: every loop ends */
        uint64_t again = 1;
        (void)!write(hand_fd, &again, sizeof(again));
        return h->len;
    }
    free(buf->mem);   /* pyfuse3's buffer; it frees ours in turn when its loop ends */
    buf->mem = h->data;
    buf->size = (size_t)h->len;
    buf->flags = 0;
    int len = h->len;
    free(h);
    return len;
}

/* Start the thread on the last session (after any fork: a worker calls it in its own
 * process). 0, or -errno; when it cannot start, pyfuse3 is left waiting on the session's
 * descriptor itself (dup'd over the eventfd), served as without the thread. */
int shardfs_shim_start_reader(void)
{
    if (!reader_wanted || last_session == NULL || reader_running)
        return -EINVAL;
    /* Fresh eventfds in this process (a forked worker shares its parent's otherwise). */
    int fresh = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
    if (fresh < 0 || dup3(fresh, hand_fd, O_CLOEXEC) < 0) {
        int err = errno;
        if (fresh >= 0)
            close(fresh);
        return -err;
    }
    close(fresh);
    if (stop_fd >= 0)
        close(stop_fd);
    stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    /* Signals stay with Python's threads: the thread starts with all of them blocked. */
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &before);
    int err = stop_fd < 0 ? errno : pthread_create(&reader, NULL, reader_main, last_session);
    pthread_sigmask(SIG_SETMASK, &before, NULL);
    if (err != 0) {
        dup3(shardfs_shim_session_fd(), hand_fd, O_CLOEXEC);   /* serve without it */
        return -err;
    }
    pthread_setname_np(reader, "shardfs-fuse");
    reader_running = 1;
    return 0;
}

/* Stop the thread and wait for it (requests it handed over and nobody took stay unanswered:
 * a next daemon asks the kernel to send them again). */
void shardfs_shim_stop_reader(void)
{
    if (!reader_running)
        return;
    uint64_t one = 1;
    (void)!write(stop_fd, &one, sizeof(one));
    pthread_join(reader, NULL);
    reader_running = 0;
}

/* Requests the thread answered in C, and handed to pyfuse3 (Python: shim.reader_counts()). */
void shardfs_shim_reader_counts(uint64_t *answered, uint64_t *handed)
{
    *answered = __atomic_load_n(&reader_answered, __ATOMIC_RELAXED);
    *handed = __atomic_load_n(&reader_handed, __ATOMIC_RELAXED);
}
