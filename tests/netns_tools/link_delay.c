/* Constant link delay in user space, for kernels without netem: every packet that a netfilter
 * rule (iptables' NFQUEUE target) sends to queue number Q is accepted exactly D microseconds
 * after it reached this program.
 *
 *     link_delay Q D        prints "ready" once bound; exits cleanly on SIGTERM or SIGINT
 *
 * Verdicts come due in arrival order (the delay is the same for all), so the pending packets
 * are a FIFO of (packet id, due time) and one batch verdict accepts every packet due so far.
 * Build: cc -O2 link_delay.c -lnetfilter_queue -lnfnetlink */
#define _GNU_SOURCE /* ppoll */
#include <arpa/inet.h> /* before the kernel's headers, which defer to libc's definitions */
#include <errno.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <libnetfilter_queue/libnetfilter_queue.h>

#define QUEUE_MAXLEN 65536u
#define FIFO_SLOTS (2u * QUEUE_MAXLEN) /* the kernel holds at most QUEUE_MAXLEN */
#define RCVBUF_BYTES (32u << 20)

struct pending {
    uint32_t id;
    int64_t due_ns;
};

struct delay_state {
    struct nfq_q_handle *queue;
    struct pending *fifo;
    uint32_t head, count;
    int64_t delay_ns, now_ns;
    int64_t lead_ns; /* timers are aimed this early: the average lateness of a timer wake-up */
    uint64_t packets, overflows, enobufs, verdicts;
    int64_t late_ns_total, late_ns_max; /* how far after its due time a verdict went out */
};

static volatile sig_atomic_t stopping;

static void on_signal(int signo) { (void)signo; stopping = 1; }

static int64_t monotonic_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* Accepting id also accepts every earlier id still queued: the kernel numbers packets in the
 * order it hands them to us, and the FIFO is in that order too. */
static void accept_through(struct delay_state *s, uint32_t id) {
    nfq_set_verdict_batch(s->queue, id, NF_ACCEPT);
}

static void release_due(struct delay_state *s, int64_t now_ns, int all) {
    uint32_t last = 0;
    int any = 0;
    while (s->count && (all || s->fifo[s->head].due_ns - s->lead_ns <= now_ns)) {
        int64_t late_ns = now_ns - s->fifo[s->head].due_ns;
        last = s->fifo[s->head].id;
        any = 1;
        if (!all) {
            s->verdicts++;
            s->late_ns_total += late_ns;
            s->late_ns_max = late_ns > s->late_ns_max ? late_ns : s->late_ns_max;
        }
        s->head = (s->head + 1) % FIFO_SLOTS;
        s->count--;
    }
    if (any)
        accept_through(s, last);
}

static int on_packet(struct nfq_q_handle *queue, struct nfgenmsg *msg, struct nfq_data *data,
                     void *arg) {
    struct delay_state *s = arg;
    struct nfqnl_msg_packet_hdr *header = nfq_get_msg_packet_hdr(data);
    (void)queue;
    (void)msg;
    if (header == NULL)
        return 0;
    if (s->count == FIFO_SLOTS) { /* cannot happen with the kernel's maxlen; never block */
        s->overflows++;
        release_due(s, s->fifo[s->head].due_ns, 0);
    }
    s->fifo[(s->head + s->count) % FIFO_SLOTS] =
        (struct pending){ntohl(header->packet_id), s->now_ns + s->delay_ns};
    s->count++;
    s->packets++;
    return 0;
}

static struct nfq_q_handle *bind_queue(struct nfq_handle *handle, unsigned number,
                                       struct delay_state *s) {
    struct nfq_q_handle *queue = nfq_create_queue(handle, number, on_packet, s);
    uint32_t flags = NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN;
    if (queue == NULL)
        return NULL;
    if (nfq_set_mode(queue, NFQNL_COPY_META, 0) < 0 ||
        nfq_set_queue_maxlen(queue, QUEUE_MAXLEN) < 0 ||
        nfq_set_queue_flags(queue, flags, flags) < 0) {
        nfq_destroy_queue(queue);
        return NULL;
    }
    nfnl_rcvbufsiz(nfq_nfnlh(handle), RCVBUF_BYTES);
    return queue;
}

/* Read every message waiting on the socket; ENOBUFS (the socket overflowed) costs only the
 * delay of the packets it dropped: with FAIL_OPEN the kernel accepts them undelayed. */
static int drain(struct nfq_handle *handle, int fd, struct delay_state *s, char *buf,
                 size_t size) {
    for (;;) {
        ssize_t got = recv(fd, buf, size, MSG_DONTWAIT);
        if (got >= 0) {
            s->now_ns = monotonic_ns();
            nfq_handle_packet(handle, buf, (int)got);
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
            return 0;
        if (errno == ENOBUFS) {
            s->enobufs++;
            continue;
        }
        perror("link_delay: recv");
        return -1;
    }
}

/* Sleep until a packet arrives or the next verdict is due. A timer wakes us some tens of
 * microseconds late in a VM, as much as the delays emulated, so the timer is aimed early by the
 * average lateness seen so far (capped at half the delay). */
static void wait_for_packets(int fd, struct delay_state *s) {
    struct pollfd poller = {.fd = fd, .events = POLLIN};
    struct timespec timeout;
    int64_t target_ns, wait_ns, late_ns;
    if (s->count == 0) {
        ppoll(&poller, 1, NULL, NULL);
        return;
    }
    target_ns = s->fifo[s->head].due_ns - s->lead_ns;
    wait_ns = target_ns - monotonic_ns();
    if (wait_ns <= 0)
        return;
    timeout.tv_sec = wait_ns / 1000000000;
    timeout.tv_nsec = wait_ns % 1000000000;
    if (ppoll(&poller, 1, &timeout, NULL) != 0)
        return; /* a packet or a signal: not a timer wake-up */
    late_ns = monotonic_ns() - target_ns;
    s->lead_ns += (late_ns - s->lead_ns) / 8;
    if (s->lead_ns < 0)
        s->lead_ns = 0;
    if (s->lead_ns > s->delay_ns / 2)
        s->lead_ns = s->delay_ns / 2;
}

static int run(struct nfq_handle *handle, struct delay_state *s) {
    static char buf[1 << 16];
    int fd = nfq_fd(handle);
    while (!stopping) {
        wait_for_packets(fd, s);
        if (drain(handle, fd, s, buf, sizeof buf) < 0)
            return 1;
        release_due(s, monotonic_ns(), 0);
    }
    release_due(s, 0, 1);
    return 0;
}

int main(int argc, char **argv) {
    struct delay_state state = {0};
    struct sigaction stop = {.sa_handler = on_signal}; /* no SA_RESTART: ppoll returns EINTR */
    struct nfq_handle *handle;
    int status;
    if (argc != 3) {
        fprintf(stderr, "usage: %s QUEUE_NUMBER DELAY_US\n", argv[0]);
        return 2;
    }
    state.delay_ns = strtoll(argv[2], NULL, 10) * 1000;
    state.fifo = calloc(FIFO_SLOTS, sizeof *state.fifo);
    prctl(PR_SET_TIMERSLACK, 1UL); /* the default 50 us of slack would be as large as D */
    /* A link is not a process: a real-time policy keeps the delay from growing by however long
     * the busy processes under test hold the cores (netem runs in the kernel's timers). */
    if (sched_setscheduler(0, SCHED_FIFO, &(struct sched_param){.sched_priority = 10}) < 0)
        perror("link_delay: no real-time priority, delays may run late");
    sigaction(SIGTERM, &stop, NULL);
    sigaction(SIGINT, &stop, NULL);
    handle = nfq_open();
    if (handle == NULL || state.fifo == NULL) {
        perror("link_delay: nfq_open");
        return 1;
    }
    state.queue = bind_queue(handle, (unsigned)atoi(argv[1]), &state);
    if (state.queue == NULL) {
        perror("link_delay: binding the queue");
        nfq_close(handle);
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    status = run(handle, &state);
    nfq_destroy_queue(state.queue);
    nfq_close(handle);
    fprintf(stderr, "link_delay: %llu packets delayed, verdicts late by %.1f us on average "
            "(at most %.1f; timers aimed %.1f us early), %llu socket overflows, "
            "%llu fifo overflows\n", (unsigned long long)state.packets,
            state.verdicts ? state.late_ns_total / 1e3 / state.verdicts : 0.0,
            state.late_ns_max / 1e3, state.lead_ns / 1e3, (unsigned long long)state.enobufs,
            (unsigned long long)state.overflows);
    free(state.fifo);
    return status;
}
