/*
 * shardfs.sources._bodysplice: an HTTP body received into a file by a thread of C (our code;
 * docs/sources.md, "Bodies spliced by a thread of C").
 *
 * A whole-shard download over plain http:// moves its body from the socket through a pipe
 * into the cache file with splice(2). Done on the daemon's loop thread, those two splices
 * were about 40 % of that thread's time per cold file (docs/benchmarks-notes.md). Here a
 * thread of C does them, never holding the GIL, and tells the loop what it wrote through an
 * eventfd (one write per piece; the counter coalesces pieces while the loop is busy).
 *
 * The threads are kept: one that finished a body waits IDLE_S for the next before it ends,
 * so that a body costs the loop no thread start (~40 µs of CPU each on the project's VM, ~400
 * bodies in a pass of the bench's 20,000 files). Each body's pipe is made and closed by its
 * thread: an idle thread holds no descriptor.
 *
 *   r = start(sock, into, at, count, timeout_ms, pipe_bytes)
 *   r.fileno()   the eventfd to wait on (readable: something new in `progress`)
 *   r.progress() (written, spliced, state, err): bytes written into `into` so far, of them
 *                spliced (the rest copied: a file that takes no splice write); the state
 *                (RUNNING, DONE, EOF, TIMEOUT, SOCKET_ERROR, FILE_ERROR, STOPPED) and errno
 *   r.stop()     stops the body and waits for its thread to leave it (also done when `r`
 *                is freed)
 *
 * The socket is non-blocking; the thread waits in poll(2) with `timeout_ms` for bytes, and
 * on a second eventfd that stop() writes. `sock` and `into` stay the caller's: it must keep
 * them open until stop() returned or the state left RUNNING.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>   /* first (it sets _GNU_SOURCE) */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define THREAD_NAME "shardfs-body"  /* as profiles and /proc/<pid>/task/<tid>/comm show it */
#define IDLE_S 30  /* a thread with no body for this long ends */

enum { RUNNING, DONE, END_OF_STREAM, TIMED_OUT, SOCKET_ERROR, FILE_ERROR, STOPPED };

typedef struct Receiver {
    PyObject_HEAD
    int sock, into;
    int64_t at, count;
    int timeout_ms;
    size_t pipe_bytes;
    int progress_fd, stop_fd;
    _Atomic int64_t written, spliced;
    _Atomic int state;
    int err;
    _Atomic int stopping;
    int queued, left_by_thread;  /* under pool.lock: handed to the threads; they are done */
    struct Receiver *next;  /* the next body waiting for a thread (pool.first's list) */
} Receiver;

typedef struct {
    int out, in;  /* a body's pipe (out: the read end) */
} Pipe;

/* The kept threads and the bodies waiting for one (a FIFO list). A body is started only
 * where an idle thread is left for it: each waiting body counts against the idle threads
 * until one takes it, so that two bodies started at once never wait for the same thread. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t work;  /* an idle thread waits here for a body */
    pthread_cond_t left;  /* stop() waits here for its body's thread to leave it */
    Receiver *first, *last;
    int idle;  /* threads waiting for a body */
    int waiting;  /* bodies in the list, not taken yet */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          NULL, NULL, 0, 0};

static void signal_fd(int fd)
{
    uint64_t one = 1;
    ssize_t ignored = write(fd, &one, sizeof one);
    (void)ignored;  /* an eventfd only refuses at its maximum count: it is readable then */
}

/* Moves `n` bytes from the pipe into the file at `at`; the bytes the file's splice refuses
 * (EINVAL: a file system without splice writes) are read from the pipe and pwritten. Returns
 * 0, or an errno. */
static int pipe_to_file(Receiver *r, Pipe *pipe, int64_t n, int64_t at, int *splice_writes)
{
    while (n > 0 && *splice_writes) {
        loff_t off = at;
        ssize_t k = splice(pipe->out, NULL, r->into, &off, (size_t)n, SPLICE_F_MOVE);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EINVAL)
                return errno;
            *splice_writes = 0;
            break;
        }
        if (k == 0)
            return ENOSPC;  /* the file took nothing and said not why */
        n -= k;
        at += k;
        atomic_fetch_add(&r->spliced, k);
    }
    char buf[65536];
    while (n > 0) {
        ssize_t k = read(pipe->out, buf, n < (int64_t)sizeof buf ? (size_t)n : sizeof buf);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return k < 0 ? errno : EIO;
        for (ssize_t w = 0; w < k;) {
            ssize_t m = pwrite(r->into, buf + w, (size_t)(k - w), at + w);
            if (m < 0 && errno == EINTR)
                continue;
            if (m <= 0)
                return m < 0 ? errno : ENOSPC;
            w += m;
        }
        n -= k;
        at += k;
    }
    return 0;
}

static void finish(Receiver *r, int state, int err)
{
    r->err = err;
    atomic_store(&r->state, state);
    signal_fd(r->progress_fd);
}

static void close_fd(int *fd)
{
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

/* Receives r's body through `pipe`, to its end or until it fails or is stopped. */
static void receive_through(Receiver *r, Pipe *pipe)
{
    int64_t left = r->count, at = r->at;
    int splice_writes = 1;
    while (left > 0) {
        if (atomic_load(&r->stopping)) {
            finish(r, STOPPED, 0);
            return;
        }
        size_t want = left < (int64_t)r->pipe_bytes ? (size_t)left : r->pipe_bytes;
        ssize_t n = splice(r->sock, NULL, pipe->in, NULL, want,
                           SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN) {
                finish(r, SOCKET_ERROR, errno);
                return;
            }
            struct pollfd fds[2] = {{r->sock, POLLIN, 0}, {r->stop_fd, POLLIN, 0}};
            int ready = poll(fds, 2, r->timeout_ms);
            if (ready < 0 && errno != EINTR) {
                finish(r, SOCKET_ERROR, errno);
                return;
            }
            if (ready == 0) {
                finish(r, TIMED_OUT, 0);
                return;
            }
            continue;  /* readable, hung up, stopping: the next turn tells */
        }
        if (n == 0) {
            finish(r, END_OF_STREAM, 0);
            return;
        }
        int err = pipe_to_file(r, pipe, n, at, &splice_writes);
        if (err) {
            finish(r, FILE_ERROR, err);
            return;
        }
        left -= n;
        at += n;
        atomic_fetch_add(&r->written, n);
        if (left > 0)
            signal_fd(r->progress_fd);
    }
    finish(r, DONE, 0);
}

/* Receives r's body through a pipe of its own, made and closed here (off the loop): an idle
 * thread holds no descriptors, and no bytes a failed body left in a pipe reach the next. */
static void receive(Receiver *r)
{
    int fds[2];
    if (atomic_load(&r->stopping)) {
        finish(r, STOPPED, 0);
        return;
    }
    if (pipe2(fds, O_CLOEXEC) < 0) {
        finish(r, FILE_ERROR, errno);
        return;
    }
    Pipe pipe = {fds[0], fds[1]};
    (void)fcntl(pipe.in, F_SETPIPE_SZ, (int)r->pipe_bytes);  /* the default works, slower */
    receive_through(r, &pipe);
    close_fd(&pipe.out);
    close_fd(&pipe.in);
}

/* A kept thread: takes the bodies waiting, one at a time; ends after IDLE_S without one. */
static void *serve(void *unused)
{
    (void)unused;
    pthread_setname_np(pthread_self(), THREAD_NAME);
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.first == NULL) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += IDLE_S;
            pool.idle++;
            int waited = pthread_cond_timedwait(&pool.work, &pool.lock, &until);
            pool.idle--;
            if (waited == ETIMEDOUT && pool.first == NULL) {
                pthread_mutex_unlock(&pool.lock);
                return NULL;
            }
        }
        Receiver *r = pool.first;
        pool.first = r->next;
        if (pool.first == NULL)
            pool.last = NULL;
        pool.waiting--;
        pthread_mutex_unlock(&pool.lock);
        receive(r);
        pthread_mutex_lock(&pool.lock);
        r->left_by_thread = 1;  /* from here on r may be freed */
        pthread_cond_broadcast(&pool.left);
    }
}

/* In a forked child the kept threads are gone (only the forking thread is copied), and the
 * lock may have been held by one of them: start afresh. */
static void forget_threads(void)
{
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.left, NULL);
    pool.first = pool.last = NULL;
    pool.idle = pool.waiting = 0;
}

static void stop_and_wait(Receiver *r)
{
    if (!r->queued)
        return;
    atomic_store(&r->stopping, 1);
    signal_fd(r->stop_fd);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&pool.lock);
    while (!r->left_by_thread)
        pthread_cond_wait(&pool.left, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    Py_END_ALLOW_THREADS
    r->queued = 0;
}

static void Receiver_dealloc(Receiver *r)
{
    stop_and_wait(r);
    close_fd(&r->progress_fd);
    close_fd(&r->stop_fd);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Receiver_fileno(Receiver *r, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong(r->progress_fd);
}

static PyObject *Receiver_progress(Receiver *r, PyObject *unused)
{
    (void)unused;
    int state = atomic_load(&r->state);  /* first: `err` and the counts are set before it */
    return Py_BuildValue("(LLii)", (long long)atomic_load(&r->written),
                         (long long)atomic_load(&r->spliced), state, r->err);
}

static PyObject *Receiver_stop(Receiver *r, PyObject *unused)
{
    (void)unused;
    stop_and_wait(r);
    Py_RETURN_NONE;
}

static PyMethodDef Receiver_methods[] = {
    {"fileno", (PyCFunction)Receiver_fileno, METH_NOARGS, "The eventfd that tells of progress."},
    {"progress", (PyCFunction)Receiver_progress, METH_NOARGS,
     "(written, spliced, state, errno) as the thread last left them."},
    {"stop", (PyCFunction)Receiver_stop, METH_NOARGS,
     "Stop the body and wait for its thread to leave it."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReceiverType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shardfs.sources._bodysplice.Receiver",
    .tp_basicsize = sizeof(Receiver),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A body being received into a file by a thread of C.",
    .tp_dealloc = (destructor)Receiver_dealloc,
    .tp_methods = Receiver_methods,
};

static PyObject *start(PyObject *module, PyObject *args)
{
    (void)module;
    int sock, into, timeout_ms;
    long long at, count;
    Py_ssize_t pipe_bytes;
    if (!PyArg_ParseTuple(args, "iiLLin", &sock, &into, &at, &count, &timeout_ms, &pipe_bytes))
        return NULL;
    if (count < 0 || at < 0 || pipe_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "negative offset or count, or an empty pipe");
        return NULL;
    }
    Receiver *r = PyObject_New(Receiver, &ReceiverType);
    if (r == NULL)
        return NULL;
    r->sock = sock;
    r->into = into;
    r->at = at;
    r->count = count;
    r->timeout_ms = timeout_ms;
    r->pipe_bytes = (size_t)pipe_bytes;
    r->progress_fd = r->stop_fd = -1;
    atomic_init(&r->written, 0);
    atomic_init(&r->spliced, 0);
    atomic_init(&r->state, RUNNING);
    atomic_init(&r->stopping, 0);
    r->err = 0;
    r->queued = r->left_by_thread = 0;
    r->next = NULL;
    r->progress_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    r->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (r->progress_fd < 0 || r->stop_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    /* Handed to an idle thread no other waiting body counts on, or to a new one (which then
     * stays for later bodies). */
    int err = 0;
    pthread_mutex_lock(&pool.lock);
    if (pool.last != NULL)
        pool.last->next = r;
    else
        pool.first = r;
    pool.last = r;
    pool.waiting++;
    if (pool.idle >= pool.waiting) {
        pthread_cond_signal(&pool.work);
    } else {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        err = pthread_create(&thread, &attr, serve, NULL);
        pthread_attr_destroy(&attr);
        if (err) {  /* taken back out of the list: it is the last */
            Receiver **at = &pool.first;
            while (*at != r)
                at = &(*at)->next;
            *at = NULL;
            pool.last = NULL;
            for (Receiver *q = pool.first; q != NULL; q = q->next)
                pool.last = q;
            pool.waiting--;
        }
    }
    pthread_mutex_unlock(&pool.lock);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    r->queued = 1;
    return (PyObject *)r;
}

static PyMethodDef module_methods[] = {
    {"start", start, METH_VARARGS,
     "start(sock, into, at, count, timeout_ms, pipe_bytes) -> Receiver: a thread of C "
     "splices `count` bytes of the socket's stream into the file `into` from offset `at`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_bodysplice",
    "HTTP bodies spliced into files by a thread of C (docs/sources.md).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__bodysplice(void)
{
    if (PyType_Ready(&ReceiverType) < 0)
        return NULL;
    if (pthread_atfork(NULL, NULL, forget_threads) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    const struct { const char *name; int value; } states[] = {
        {"RUNNING", RUNNING}, {"DONE", DONE}, {"EOF", END_OF_STREAM}, {"TIMEOUT", TIMED_OUT},
        {"SOCKET_ERROR", SOCKET_ERROR}, {"FILE_ERROR", FILE_ERROR}, {"STOPPED", STOPPED},
    };
    if (PyModule_AddStringConstant(m, "THREAD_NAME", THREAD_NAME) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    for (size_t i = 0; i < sizeof states / sizeof states[0]; i++)
        if (PyModule_AddIntConstant(m, states[i].name, states[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
