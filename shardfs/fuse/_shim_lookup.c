/*
 * The page push's lookups, made by a process of their own (part of _shim.c, #included by
 * _shim_meta.c; shardfs/fuse/pagepush.py says why pushes need lookups).
 *
 * Why another process: a `stat()` through the mount is a LOOKUP this mount's daemon answers.
 * Made by a thread of a process that serves the mount itself (the daemon serving alone), it
 * is a request to itself; SIGKILLed after its reader thread has read that LOOKUP and before
 * it answered, the process can never exit: the kernel waits for the answer to a request
 * already read without interruption, so the thread stays in D state, the process keeps its
 * /dev/fuse descriptor, the connection is never aborted, and every reader of the mount hangs
 * until someone writes 1 to the connection's `abort` (docs/design.md, "Who looks files up").
 * A stat made by this process instead ends with the connection: when the killed daemon's
 * descriptors close (or, under a holder, when the next daemon answers the resent LOOKUP).
 *
 * The process is forked (no exec) by the pusher's thread; it runs nothing but system calls
 * (what a child of a threaded process may run), holds no descriptor but its socket and
 * /dev/null (not /dev/fuse: the connection must end with the daemon's; not the daemon's
 * pipes, locks or sockets), has its working directory at / (it holds no mount busy) and ends
 * at end of file on its socket, i.e. when the daemon closes it or dies.
 *
 * The protocol, on a stream socket: the pusher writes paths, each ended by a NUL; the
 * process stats them in order and writes one byte per path: 'y' (the stat succeeded: the
 * kernel has the inode now) or 'n'.
 */
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>

#define LOOKUP_BUF (64u << 10)   /* the process's read buffer: more than a batch of paths */

static int write_all(int fd, const char *data, size_t n)
{
    while (n > 0) {
        ssize_t put = send(fd, data, n, MSG_NOSIGNAL);
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

/* Only the descriptors the process needs: /dev/null as 0-2, its socket as 3. */
static void lookup_keep_only(int sock)
{
    if (sock != 3) {
        if (dup2(sock, 3) < 0)
            _exit(1);
    }
    if (syscall(SYS_close_range, 4u, ~0u, 0u) != 0) {
        struct rlimit lim;
        long top = getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY
                   ? (long)lim.rlim_cur : 65536;
        for (long fd = 4; fd < top; fd++)
            close((int)fd);
    }
    int null = open("/dev/null", O_RDWR);
    if (null < 0)
        _exit(1);
    for (int fd = 0; fd < 3; fd++)
        if (null != fd)
            dup2(null, fd);
    if (null > 3)
        close(null);
}

static void lookup_serve(int sock) __attribute__((noreturn));

static void lookup_serve(int sock)
{
    /* The daemon's signal handlers are Python's (meaningless here): the defaults, unblocked. */
    for (int sig = 1; sig < NSIG; sig++)
        if (sig != SIGKILL && sig != SIGSTOP)
            signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    prctl(PR_SET_NAME, "shardfs lookup", 0, 0, 0);
    lookup_keep_only(sock);
    sock = 3;
    if (chdir("/") != 0)
        _exit(1);
    static char buf[LOOKUP_BUF];
    static char answers[LOOKUP_BUF];
    size_t have = 0;
    for (;;) {
        ssize_t got = read(sock, buf + have, sizeof(buf) - have);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            _exit(0);   /* the daemon closed its end, or died */
        have += (size_t)got;
        size_t at = 0, n = 0;
        for (;;) {
            char *end = memchr(buf + at, 0, have - at);
            if (end == NULL)
                break;
            struct stat st;
            answers[n++] = stat(buf + at, &st) == 0 ? 'y' : 'n';
            at = (size_t)(end - buf) + 1;
        }
        if (n > 0 && write_all(sock, answers, n) != 0)
            _exit(0);
        if (at == 0 && have == sizeof(buf))
            _exit(1);   /* a path longer than the buffer: not the pusher's protocol */
        memmove(buf, buf + at, have - at);
        have -= at;
    }
}

/* Start the lookup process: its pid in *pid, and the pusher's end of its socket (close it to
 * end the process; reap it with waitpid), or -errno. */
int shardfs_shim_lookup_start(int *pid)
{
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0)
        return -errno;
    pid_t child = fork();
    if (child < 0) {
        int err = errno;
        close(pair[0]);
        close(pair[1]);
        return -err;
    }
    if (child == 0)
        lookup_serve(pair[1]);
    close(pair[1]);
    *pid = child;
    return pair[0];
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
