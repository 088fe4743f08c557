/* A TCP relay that delays every byte by a fixed time in each direction: the network of
 * bench/harness/netlab.py (this kernel has no netem).
 *
 *   relay DELAY_US [udp:]LISTEN_IP:PORT=TARGET_IP:PORT [...]
 *
 * A udp: pair relays datagrams (WireGuard's, for the hosts' tunnels): each client's
 * datagrams to LISTEN go on to TARGET from a socket of that client's own, whose replies
 * come back to the client from LISTEN; every datagram is held DELAY_US, in order, by one
 * sender thread per pair.
 *
 * For every pair: accept on LISTEN, connect to TARGET, and copy both ways. Each direction
 * has a reader thread, which stamps every chunk it reads with (now + DELAY_US), and a writer
 * thread, which sends each chunk at its stamp (clock_nanosleep on CLOCK_MONOTONIC, timer
 * slack 1 us). Bandwidth is not limited; order is kept. With DELAY_US 0 the chunks still
 * pass through both threads, so that a run at 0 measures what the relay itself costs.
 * Prints "relay: ready" on stdout once every listener is bound. Built by netlab.py with
 * `cc -O2 -pthread`.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 65536

static long long delay_ns;

/* What the delay queue holds: a chunk of a TCP stream or a datagram begins with one. */
struct item {
    struct item *next;
    long long due_ns;
};

/* Items in the order read, each sent at its stamp by the one thread that pops them. */
struct queue {
    pthread_mutex_t lock;
    pthread_cond_t ready;
    struct item *head, *tail;
};

struct chunk {
    struct item item;
    ssize_t len; /* 0: end of stream */
    char data[];
};

struct pipe {
    int in, out;
    struct queue queue;
    struct conn *conn;
};

struct conn {
    int a, b;
    atomic_int threads; /* the four threads left; the last closes both sockets */
    struct pipe up, down;
};

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void release(struct conn *c) {
    if (atomic_fetch_sub(&c->threads, 1) == 1) {
        close(c->a);
        close(c->b);
        free(c);
    }
}

static void queue_init(struct queue *q) {
    q->head = q->tail = NULL;
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->ready, NULL);
}

/* Stamps ``it`` with now + the delay and appends it. */
static void push(struct queue *q, struct item *it) {
    it->next = NULL;
    it->due_ns = now_ns() + delay_ns;
    pthread_mutex_lock(&q->lock);
    if (q->tail)
        q->tail->next = it;
    else
        q->head = it;
    q->tail = it;
    pthread_cond_signal(&q->ready);
    pthread_mutex_unlock(&q->lock);
}

/* The oldest item, once its stamp has come (waits for one, then sleeps until then). */
static struct item *pop_due(struct queue *q) {
    pthread_mutex_lock(&q->lock);
    while (!q->head)
        pthread_cond_wait(&q->ready, &q->lock);
    struct item *it = q->head;
    q->head = it->next;
    if (!q->head)
        q->tail = NULL;
    pthread_mutex_unlock(&q->lock);
    if (delay_ns > 0) {
        struct timespec due = {it->due_ns / 1000000000LL, it->due_ns % 1000000000LL};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &due, NULL) == EINTR) {
        }
    }
    return it;
}

static void *reader(void *arg) {
    struct pipe *p = arg;
    for (;;) {
        struct chunk *ch = malloc(sizeof *ch + CHUNK);
        if (!ch)
            abort();
        ssize_t n = recv(p->in, ch->data, CHUNK, 0);
        if (n < 0 && errno == EINTR) {
            free(ch);
            continue;
        }
        ch->len = n > 0 ? n : 0;
        push(&p->queue, &ch->item);
        if (n <= 0)
            break;
    }
    release(p->conn);
    return NULL;
}

static void *writer(void *arg) {
    struct pipe *p = arg;
    int failed = 0;
    for (;;) {
        struct chunk *ch = (struct chunk *)pop_due(&p->queue);
        if (ch->len == 0) {
            free(ch);
            break;
        }
        for (ssize_t sent = 0; !failed && sent < ch->len;) {
            ssize_t n = send(p->out, ch->data + sent, ch->len - sent, MSG_NOSIGNAL);
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0)
                failed = 1; /* the peer went away: keep draining, send no more */
            else
                sent += n;
        }
        free(ch);
        if (failed)
            shutdown(p->in, SHUT_RDWR); /* ends this direction's reader */
    }
    shutdown(p->out, SHUT_WR);
    release(p->conn);
    return NULL;
}

static int parse(const char *text, struct sockaddr_in *addr) {
    char host[64];
    const char *colon = strrchr(text, ':');
    if (!colon || colon - text >= (long)sizeof host)
        return -1;
    memcpy(host, text, colon - text);
    host[colon - text] = 0;
    memset(addr, 0, sizeof *addr);
    addr->sin_family = AF_INET;
    addr->sin_port = htons((unsigned short)atoi(colon + 1));
    return inet_pton(AF_INET, host, &addr->sin_addr) == 1 ? 0 : -1;
}

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void start(pthread_t *t, void *(*fn)(void *), void *arg) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    if (pthread_create(t, &attr, fn, arg) != 0)
        abort();
    pthread_attr_destroy(&attr);
}

static void init_pipe(struct pipe *p, int in, int out, struct conn *c) {
    p->in = in;
    p->out = out;
    p->conn = c;
    queue_init(&p->queue);
}

struct listener {
    int fd;
    struct sockaddr_in target;
};

static void *acceptor(void *arg) {
    struct listener *l = arg;
    for (;;) {
        int a = accept(l->fd, NULL, NULL);
        if (a < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            perror("relay: accept");
            exit(1);
        }
        int b = socket(AF_INET, SOCK_STREAM, 0);
        if (b < 0 || connect(b, (struct sockaddr *)&l->target, sizeof l->target) < 0) {
            if (b >= 0)
                close(b); /* the target is not up yet: the client sees a reset and retries */
            close(a);
            continue;
        }
        nodelay(a);
        nodelay(b);
        struct conn *c = calloc(1, sizeof *c);
        if (!c)
            abort();
        c->a = a;
        c->b = b;
        atomic_init(&c->threads, 4);
        init_pipe(&c->up, a, b, c);
        init_pipe(&c->down, b, a, c);
        pthread_t t;
        start(&t, reader, &c->up);
        start(&t, writer, &c->up);
        start(&t, reader, &c->down);
        start(&t, writer, &c->down);
    }
    return NULL;
}

/* ---- UDP: one delay queue per pair, one thread reading each socket ---- */

#define DATAGRAM 65536
#define CLIENTS 64

struct datagram {
    struct item item;
    int fd;
    struct sockaddr_in to;
    ssize_t len;
    char data[];
};

struct udp_pair;

struct udp_client {
    struct udp_pair *pair;
    struct sockaddr_in addr; /* the client, as LISTEN sees it */
    int fd;                  /* connected to TARGET */
};

struct udp_pair {
    int fd; /* bound to LISTEN */
    struct sockaddr_in target;
    struct queue queue;
    struct udp_client clients[CLIENTS];
    int count;
};

static void udp_push(struct udp_pair *p, int fd, const struct sockaddr_in *to, const char *data,
                     ssize_t len) {
    struct datagram *d = malloc(sizeof *d + len);
    if (!d)
        abort();
    d->fd = fd;
    d->to = *to;
    d->len = len;
    memcpy(d->data, data, len);
    push(&p->queue, &d->item);
}

static void *udp_sender(void *arg) {
    struct udp_pair *p = arg;
    for (;;) {
        struct datagram *d = (struct datagram *)pop_due(&p->queue);
        sendto(d->fd, d->data, d->len, 0, (struct sockaddr *)&d->to, sizeof d->to);
        free(d);
    }
    return NULL;
}

static void *udp_replies(void *arg) {
    struct udp_client *c = arg;
    char *buf = malloc(DATAGRAM);
    for (;;) {
        ssize_t n = recv(c->fd, buf, DATAGRAM, 0);
        if (n < 0 && (errno == EINTR || errno == ECONNREFUSED))
            continue; /* the target is not up yet */
        if (n < 0)
            break;
        udp_push(c->pair, c->pair->fd, &c->addr, buf, n);
    }
    free(buf);
    return NULL;
}

static struct udp_client *udp_client(struct udp_pair *p, const struct sockaddr_in *from) {
    for (int i = 0; i < p->count; i++)
        if (p->clients[i].addr.sin_addr.s_addr == from->sin_addr.s_addr &&
            p->clients[i].addr.sin_port == from->sin_port)
            return &p->clients[i];
    if (p->count == CLIENTS)
        return NULL;
    struct udp_client *c = &p->clients[p->count];
    c->pair = p;
    c->addr = *from;
    c->fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&p->target, sizeof p->target) < 0) {
        perror("relay: udp connect");
        exit(1);
    }
    p->count++;
    pthread_t t;
    start(&t, udp_replies, c);
    return c;
}

static void *udp_listener(void *arg) {
    struct udp_pair *p = arg;
    char *buf = malloc(DATAGRAM);
    for (;;) {
        struct sockaddr_in from;
        socklen_t size = sizeof from;
        ssize_t n = recvfrom(p->fd, buf, DATAGRAM, 0, (struct sockaddr *)&from, &size);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            perror("relay: udp recvfrom");
            exit(1);
        }
        struct udp_client *c = udp_client(p, &from);
        if (c)
            udp_push(p, c->fd, &p->target, buf, n);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: relay DELAY_US LISTEN_IP:PORT=TARGET_IP:PORT [...]\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_TIMERSLACK, 1000UL); /* ns: wake at the stamp, not 50 us after it */
    delay_ns = atoll(argv[1]) * 1000LL;
    int count = argc - 2;
    struct listener *ls = calloc(count, sizeof *ls);
    struct udp_pair *us = calloc(count, sizeof *us);
    for (int i = 0; i < count; i++) {
        char spec[160];
        snprintf(spec, sizeof spec, "%s", argv[i + 2]);
        if (strncmp(spec, "udp:", 4) == 0) {
            char *eq = strchr(spec, '=');
            struct sockaddr_in listen_at;
            if (!eq) {
                fprintf(stderr, "relay: %s: not udp:LISTEN=TARGET\n", argv[i + 2]);
                return 2;
            }
            *eq = 0;
            if (parse(spec + 4, &listen_at) < 0 || parse(eq + 1, &us[i].target) < 0) {
                fprintf(stderr, "relay: %s: not udp:IP:PORT=IP:PORT\n", argv[i + 2]);
                return 2;
            }
            us[i].fd = socket(AF_INET, SOCK_DGRAM, 0);
            if (bind(us[i].fd, (struct sockaddr *)&listen_at, sizeof listen_at) < 0) {
                fprintf(stderr, "relay: %s: %s\n", spec, strerror(errno));
                return 1;
            }
            queue_init(&us[i].queue);
            ls[i].fd = -1;
            continue;
        }
        char *eq = strchr(spec, '=');
        struct sockaddr_in listen_at;
        if (!eq) {
            fprintf(stderr, "relay: %s: not LISTEN=TARGET\n", argv[i + 2]);
            return 2;
        }
        *eq = 0;
        if (parse(spec, &listen_at) < 0 || parse(eq + 1, &ls[i].target) < 0) {
            fprintf(stderr, "relay: %s: not IP:PORT=IP:PORT\n", argv[i + 2]);
            return 2;
        }
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, (struct sockaddr *)&listen_at, sizeof listen_at) < 0 || listen(fd, 128) < 0) {
            fprintf(stderr, "relay: %s: %s\n", spec, strerror(errno));
            return 1;
        }
        ls[i].fd = fd;
    }
    for (int i = 0; i < count; i++) {
        pthread_t t;
        if (ls[i].fd >= 0) {
            start(&t, acceptor, &ls[i]);
        } else {
            start(&t, udp_listener, &us[i]);
            start(&t, udp_sender, &us[i]);
        }
    }
    printf("relay: ready\n");
    fflush(stdout);
    pause();
    return 0;
}
