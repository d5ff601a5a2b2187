/* `pai`'s launcher, compiled: the client of the resident submit server in C.

   paicli/submit_client.py is the protocol's reference and this file follows it line
   for line: a bare statement (`pai [--detach] -name X -D...`) goes to the user's
   server with the standard descriptors, the working folder and the environment; the
   client relays the signals it gets to the server's child and leaves with its exit
   status. Anything else, and a statement the server does not take, runs the Python
   launcher (PAI_FALLBACK) with PAI_SUBMIT_SERVED saying why, so `pai` goes on exactly
   as the Python client would have (pai.main's `served`). An interpreter without
   site needs ~12 ms of a core before its first line; this needs ~1 ms.

   Built by `python -m paicli.submit_client --write-launcher PATH` (.ci/setup), which
   defines PAI_PYTHON (the interpreter: part of the server's key), PAI_ROOT (the
   checkout) and PAI_FALLBACK (the Python launcher). Anything unusual (a variable
   that is not UTF-8, a name given twice, a socket path too long) is left to the
   Python client: the fallback without PAI_SUBMIT_SERVED tries the server itself. */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

#define PROTOCOL "paicli-submit-1"
#ifndef ANSWER_TIMEOUT
#define ANSWER_TIMEOUT 20   /* seconds: submit_client.ANSWER_TIMEOUT */
#endif
#define NOT_DECIDED NULL   /* the Python launcher decides (it tries the server itself) */

extern char **environ;

static const char *VOLATILE[] = {"PAI_HOME", "PWD", "OLDPWD", "_", "SHLVL", NULL};
static const int RELAYED[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
static int child_pidfd = -1;

static void say(const char *text) {
    char line[1024];
    int n = snprintf(line, sizeof line, "pai: error: %s\n", text);
    if (n > 0 && write(2, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1) < 0) {
        /* nowhere to say it */
    }
}

/* The Python launcher, with why this client did not hand the statement over. */
static void fallback(char **argv, const char *outcome) {
    if (outcome == NOT_DECIDED || setenv("PAI_SUBMIT_SERVED", outcome, 1) != 0)
        unsetenv("PAI_SUBMIT_SERVED");
    argv[0] = PAI_FALLBACK;
    execv(PAI_FALLBACK, argv);
    char text[512];
    snprintf(text, sizeof text, "cannot run %s: %s (run `bash .ci/setup` again)", PAI_FALLBACK, strerror(errno));
    say(text);
    _exit(1);
}

static int starts_with(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

/* cli_tokens.is_bare_statement */
static int bare_statement(int argc, char **argv) {
    int lead = 1;
    while (lead < argc && (!strcmp(argv[lead], "--detach") || !strcmp(argv[lead], "-d") ||
                           !strcmp(argv[lead], "--no-progress")))
        lead++;
    if (lead >= argc || starts_with(argv[lead], "--"))
        return 0;
    return starts_with(argv[lead], "-name") || starts_with(argv[lead], "-project") || starts_with(argv[lead], "-D");
}

/* submit_client.enabled */
static int enabled(void) {
    const char *value = getenv("PAI_SUBMIT_SERVER");
    if (value == NULL)
        return 1;
    while (*value == ' ' || (*value >= '\t' && *value <= '\r'))
        value++;
    size_t n = strlen(value);
    while (n > 0 && (value[n - 1] == ' ' || (value[n - 1] >= '\t' && value[n - 1] <= '\r')))
        n--;
    static const char *OFF[] = {"0", "off", "no", "false", NULL};
    for (int i = 0; OFF[i]; i++)
        if (strlen(OFF[i]) == n && strncasecmp(value, OFF[i], n) == 0)
            return 0;
    return 1;
}

/* submit_client.server_dir: only a real folder of ours that no one else can enter. */
static int server_dir(char *path, size_t size) {
    const char *given = getenv("PAI_SUBMIT_SERVER_DIR");
    const char *runtime = getenv("XDG_RUNTIME_DIR");
    int n;
    if (given && *given)
        n = snprintf(path, size, "%s", given);
    else if (runtime && *runtime)
        n = snprintf(path, size, "%s%spaicli-submit", runtime, runtime[strlen(runtime) - 1] == '/' ? "" : "/");
    else
        n = snprintf(path, size, "/tmp/paicli-submit-%u", (unsigned)getuid());
    if (n < 0 || (size_t)n >= size)
        return 0;
    struct stat st;
    if (lstat(path, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != getuid() || (st.st_mode & 077))
        return 0;
    return 1;
}

static uint32_t crc32_update(uint32_t crc, const unsigned char *data, size_t n) {
    for (size_t i = 0; i < n; i++) {
        crc ^= data[i];
        for (int bit = 0; bit < 8; bit++)
            crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return crc;
}

static int valid_utf8(const unsigned char *s) {
    while (*s) {
        int more = *s < 0x80 ? 0 : (*s & 0xE0) == 0xC0 ? 1 : (*s & 0xF0) == 0xE0 ? 2 : (*s & 0xF8) == 0xF0 ? 3 : -1;
        if (more < 0 || (more == 1 && *s < 0xC2))
            return 0;
        s++;
        for (int i = 0; i < more; i++, s++)
            if ((*s & 0xC0) != 0x80)
                return 0;
    }
    return 1;
}

static int compare(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static size_t name_length(const char *entry) { return (size_t)(strchr(entry, '=') - entry); }

static int volatile_name(const char *entry) {
    size_t n = name_length(entry);
    for (int i = 0; VOLATILE[i]; i++)
        if (strlen(VOLATILE[i]) == n && strncmp(entry, VOLATILE[i], n) == 0)
            return 1;
    return 0;
}

/* submit_client.key: the server of this interpreter, checkout, user and environment
   (but the volatile variables); 0 where the Python client should decide. */
static int server_key(char key[9]) {
    size_t count = 0;
    for (char **e = environ; *e; e++)
        count++;
    char **sorted = malloc((count + 1) * sizeof *sorted);
    if (sorted == NULL)
        return 0;
    size_t kept = 0;
    for (char **e = environ; *e; e++) {
        if (strchr(*e, '=') == NULL || !valid_utf8((const unsigned char *)*e)) {
            free(sorted);
            return 0;
        }
        sorted[kept++] = *e;
    }
    qsort(sorted, kept, sizeof *sorted, compare);
    for (size_t i = 1; i < kept; i++) {
        size_t n = name_length(sorted[i]);
        if (n == name_length(sorted[i - 1]) && strncmp(sorted[i], sorted[i - 1], n) == 0) {
            free(sorted);   /* a name given twice */
            return 0;
        }
    }
    char uid[16];
    snprintf(uid, sizeof uid, "%u", (unsigned)getuid());
    const char *head[] = {PAI_PYTHON, PAI_ROOT, uid};
    uint32_t crc = 0xFFFFFFFFu;
    for (int i = 0; i < 3; i++) {
        if (i)
            crc = crc32_update(crc, (const unsigned char *)"", 1);
        crc = crc32_update(crc, (const unsigned char *)head[i], strlen(head[i]));
    }
    for (size_t i = 0; i < kept; i++) {
        if (volatile_name(sorted[i]))
            continue;
        crc = crc32_update(crc, (const unsigned char *)"", 1);
        crc = crc32_update(crc, (const unsigned char *)sorted[i], strlen(sorted[i]));
    }
    free(sorted);
    snprintf(key, 9, "%08x", crc ^ 0xFFFFFFFFu);
    return 1;
}

/* The request: PROTOCOL, argv[0], the argument count, the arguments and the
   environment, NUL-separated, after its length (4 bytes, big-endian). */
static char *request(int argc, char **argv, size_t *size) {
    char count[16];
    snprintf(count, sizeof count, "%d", argc - 1);
    size_t n = 4 + strlen(PROTOCOL) + 1 + strlen(argv[0]) + 1 + strlen(count);
    for (int i = 1; i < argc; i++)
        n += 1 + strlen(argv[i]);
    for (char **e = environ; *e; e++)
        n += 1 + strlen(*e);
    char *body = malloc(n + 1);   /* + the NUL the last stpcpy writes */
    if (body == NULL)
        return NULL;
    char *at = body + 4;
    const char *head[] = {PROTOCOL, argv[0], count};
    for (int i = 0; i < 3; i++) {
        if (i)
            *at++ = '\0';
        at = stpcpy(at, head[i]);
    }
    for (int i = 1; i < argc; i++) {
        *at++ = '\0';
        at = stpcpy(at, argv[i]);
    }
    for (char **e = environ; *e; e++) {
        *at++ = '\0';
        at = stpcpy(at, *e);
    }
    uint32_t payload = (uint32_t)(n - 4);
    for (int i = 0; i < 4; i++)
        body[i] = (char)(payload >> (24 - 8 * i));
    *size = n;
    return body;
}

static char pending[4096];
static size_t pending_size;

/* One answer line (and the descriptor sent with it, if `fd`): its length, 0 at EOF,
   -1 on an error (errno says which). */
static ssize_t read_line(int sock, char *line, size_t size, int *fd) {
    for (;;) {
        char *end = memchr(pending, '\n', pending_size);
        if (end != NULL) {
            size_t n = (size_t)(end - pending);
            size_t copied = n < size - 1 ? n : size - 1;
            memcpy(line, pending, copied);
            line[copied] = '\0';
            memmove(pending, end + 1, pending_size - n - 1);
            pending_size -= n + 1;
            return (ssize_t)copied + 1;
        }
        if (pending_size == sizeof pending)
            pending_size = 0;   /* a line longer than any answer: not ours */
        struct iovec iov = {pending + pending_size, sizeof pending - pending_size};
        union {
            struct cmsghdr header;
            char space[CMSG_SPACE(sizeof(int))];
        } control;
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        if (fd != NULL) {
            msg.msg_control = control.space;
            msg.msg_controllen = sizeof control.space;
        }
        ssize_t got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return -1;
        if (fd != NULL)
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c))
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len >= CMSG_LEN(sizeof(int)))
                    memcpy(fd, CMSG_DATA(c), sizeof(int));
        if (got == 0)
            return 0;
        pending_size += (size_t)got;
    }
}

static void send_signal(int signum) {
    syscall(SYS_pidfd_send_signal, child_pidfd, signum, NULL, 0);   /* gone: its status is on its way */
}

static void relay(int signum) {
    int saved = errno;
    send_signal(signum);
    errno = saved;
}

/* `signum` at its default action, delivered to this process now. */
static void raise_default(int signum) {
    signal(signum, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, signum);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    kill(getpid(), signum);
}

static void stop(int signum) {
    /* Ctrl-Z: the child stops with us and goes on when we do. */
    int saved = errno;
    send_signal(SIGSTOP);
    raise_default(signum);
    struct sigaction again = {0};
    again.sa_handler = stop;
    again.sa_flags = SA_RESTART;
    sigaction(signum, &again, NULL);
    send_signal(SIGCONT);
    errno = saved;
}

static void catch(int signum, void (*handler)(int)) {
    struct sigaction old, now = {0};
    if (sigaction(signum, NULL, &old) != 0 || old.sa_handler == SIG_IGN)
        return;   /* ignored here (nohup): left alone, as the child ignores it too */
    now.sa_handler = handler;
    now.sa_flags = SA_RESTART;
    sigaction(signum, &now, NULL);
}

/* Wait for the child's end and leave as it did. */
static void follow(int sock) {
    char line[256];
    for (;;) {
        ssize_t n = read_line(sock, line, sizeof line, NULL);
        if (n > 0 && starts_with(line, "exit "))
            _exit(atoi(line + 5));
        if (n > 0 && starts_with(line, "signal ")) {
            int signum = atoi(line + 7);
            raise_default(signum);
            _exit(128 + signum);
        }
        if (n <= 0) {
            say("the submit's process ended without a status (its server was stopped); "
                "`pai list` shows whether the job was submitted");
            _exit(1);
        }
    }
}

static void timed_out(void) {
    char text[256];
    snprintf(text, sizeof text, "the submit server did not answer within %d s; nothing was submitted "
             "(PAI_SUBMIT_SERVER=0 submits without it)", ANSWER_TIMEOUT);
    say(text);
    _exit(1);
}

/* submit_client.submit: served, it never returns; otherwise why not. */
static const char *submit(int argc, char **argv) {
    if (!enabled())
        return "off";
    char directory[4096], key[9];
    if (!server_dir(directory, sizeof directory))
        return "absent";
    if (!server_key(key))
        return NOT_DECIDED;
    struct sockaddr_un address = {0};
    address.sun_family = AF_UNIX;
    int n = snprintf(address.sun_path, sizeof address.sun_path, "%s/submit-%s.sock", directory, key);
    if (n < 0 || (size_t)n >= sizeof address.sun_path)
        return NOT_DECIDED;
    /* Not blocking while it connects: a wedged server's full backlog is EAGAIN at once. */
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (sock < 0)
        return "absent";
    if (connect(sock, (struct sockaddr *)&address, sizeof address) != 0) {
        close(sock);   /* none there (or none that takes us): nothing was sent, a cold submit is safe */
        return "absent";
    }
    fcntl(sock, F_SETFL, fcntl(sock, F_GETFL) & ~O_NONBLOCK);
    struct timeval timeout = {ANSWER_TIMEOUT, 0};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    int folder = open(".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (folder < 0) {
        close(sock);
        return "declined";   /* a working folder that is gone: the cold path says so */
    }
    struct stat st;
    size_t size = 0;
    char *body = NULL;
    if (fstat(0, &st) != 0 || fstat(1, &st) != 0 || fstat(2, &st) != 0 || !(body = request(argc, argv, &size))) {
        close(folder);
        close(sock);
        return "declined";   /* a standard descriptor closed */
    }
    int fds[4] = {0, 1, 2, folder};
    union {
        struct cmsghdr header;
        char space[CMSG_SPACE(sizeof fds)];
    } control;
    memset(&control, 0, sizeof control);
    struct iovec iov = {body, size};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.space;
    msg.msg_controllen = sizeof control.space;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(c), fds, sizeof fds);
    ssize_t sent;
    while ((sent = sendmsg(sock, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR)
        ;
    size_t done = sent > 0 ? (size_t)sent : 0;
    while (sent >= 0 && done < size) {
        sent = send(sock, body + done, size - done, MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR)
            sent = 0;
        done += sent > 0 ? (size_t)sent : 0;
    }
    free(body);
    close(folder);
    if (sent < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            timed_out();
        close(sock);
        return "declined";   /* the server went away first */
    }
    char first[256];
    int pidfd = -1;
    ssize_t got = read_line(sock, first, sizeof first, &pidfd);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        timed_out();
    if (got <= 0 || !starts_with(first, "ok")) {
        if (pidfd >= 0)
            close(pidfd);
        close(sock);
        if (got > 0 && getenv("PAI_DEBUG") && *getenv("PAI_DEBUG")) {
            char text[300];
            snprintf(text, sizeof text, "submit server: %s", first);
            say(text);
        }
        return got > 0 && starts_with(first, "no leaving") ? "absent" : "declined";
    }
    struct timeval never = {0, 0};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &never, sizeof never);
    if (pidfd >= 0) {   /* the child sends it with its "ok"; from here on the submit is its */
        child_pidfd = pidfd;
        for (size_t i = 0; i < sizeof RELAYED / sizeof RELAYED[0]; i++)
            catch(RELAYED[i], relay);
        catch(SIGTSTP, stop);
    }
    follow(sock);
    return "declined";   /* not reached */
}

int main(int argc, char **argv) {
    if (argc < 1)
        return 2;
    fallback(argv, bare_statement(argc, argv) ? submit(argc, argv) : "other");
    return 1;
}
