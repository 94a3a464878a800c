/* A client of the device node in C, from abi/accel_uapi.h and docs/uapi.md alone (no
 * Python runtime): version, query, a context with the objects it needs, device and pinned
 * host memory, a user-mode queue, a no-op rung through the doorbell page and waited for on
 * the event pipe, a copy there and back, a refused command and its reason.
 *
 *   cc -std=c11 -Wall -I abi -o raw_client examples/raw_client.c
 *   ./raw_client $ACCEL_EMU_ROOT/dev/accel/accel0
 *
 * tests/unit/test_c_header.py builds it and runs it against a mounted device. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "accel_uapi.h"

#define COPY_BYTES (1u << 20)

static int dev_fd = -1;
static uint64_t next_tag = 1;

static void die(const char *what)
{
	char reason[ACCEL_LAST_ERROR_MAX + 1] = "";
	int err = errno;
	/* the driver's reason for the last refused command (docs/uapi.md, "The reason") */
	ssize_t n = dev_fd >= 0 ? pread(dev_fd, reason, ACCEL_LAST_ERROR_MAX, ACCEL_LAST_ERROR_OFFSET) : -1;
	if (n > 0)
		reason[n] = 0;
	fprintf(stderr, "raw_client: %s: %s%s%s", what, strerror(err), n > 0 ? "; driver: " : "\n",
		n > 0 ? reason : "");
	exit(1);
}

/* One command: the header and the struct in one write; the reply (if the command has
 * one) read back at the tag. Returns 0 or the errno. */
static int call(uint32_t cmd, void *arg, size_t size)
{
	char buf[sizeof(struct accel_cmd_hdr) + 512];
	struct accel_cmd_hdr hdr = { .cmd = cmd, .flags = 0, .tag = next_tag++ };
	if (size > sizeof(buf) - sizeof(hdr))
		return EINVAL;
	memcpy(buf, &hdr, sizeof(hdr));
	memcpy(buf + sizeof(hdr), arg, size);
	if (pwrite(dev_fd, buf, sizeof(hdr) + size, 0) < 0)
		return errno;
	if (ACCEL_CMD_HAS_REPLY(cmd)) {
		if (pread(dev_fd, arg, size, (off_t)hdr.tag) != (ssize_t)size)
			return errno ? errno : EIO;
	}
	return 0;
}

#define CALL(cmd, arg) do { if ((errno = call(cmd, &(arg), sizeof(arg)))) die(#cmd); } while (0)

/* A memfd of size bytes sealed as the device needs (ACCEL_SEALS_PINNED), mapped. */
static int sealed_memfd(const char *name, size_t size, void **map)
{
	int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0 || ftruncate(fd, (off_t)size) < 0 || fcntl(fd, F_ADD_SEALS, ACCEL_SEALS_PINNED) < 0)
		die(name);
	*map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (*map == MAP_FAILED)
		die("mmap");
	return fd;
}

static volatile uint64_t *word(void *base, size_t off)
{
	return (volatile uint64_t *)((char *)base + off);
}

struct queue {
	char *ring;	/* the ring, mapped */
	uint32_t slot;	/* its doorbell slot */
	uint64_t id;
};

static char *db;	/* the doorbell page, mapped */
static int bell_w, event_r;

/* Submit one packet: write it into its ring slot, publish wptr, write the doorbell slot
 * and bump DB_SEQ, fence, and only if the firmware sleeps write one byte to the doorbell
 * pipe (docs/submission.md, "Submitting"). Returns its seqno. */
static uint64_t submit(struct queue *q, const void *packet)
{
	uint64_t wptr = *word(q->ring, ACCEL_RING_WPTR);
	memcpy(q->ring + ACCEL_RING_PACKETS + (wptr % ACCEL_RING_SLOTS) * ACCEL_PACKET_SIZE, packet,
	       ACCEL_PACKET_SIZE);
	__atomic_store_n(word(q->ring, ACCEL_RING_WPTR), wptr + 1, __ATOMIC_RELEASE);
	__atomic_store_n(word(db, ACCEL_DB_SLOTS + 8 * q->slot), wptr + 1, __ATOMIC_RELEASE);
	__atomic_fetch_add(word(db, ACCEL_DB_SEQ), 1, __ATOMIC_SEQ_CST);
	__atomic_thread_fence(__ATOMIC_SEQ_CST); /* store DB_SEQ, then load DB_FW_SLEEPING */
	if (__atomic_load_n(word(db, ACCEL_DB_FW_SLEEPING), __ATOMIC_SEQ_CST)) {
		if (write(bell_w, "", 1) < 0 && errno != EAGAIN)
			die("doorbell pipe");
	}
	return wptr + 1;
}

/* Wait for seqno: poll the fence a little, then arm RING_IRQ_SEQNO, re-check the fence
 * (it may have passed before the arming was seen: no byte comes then), and sleep in
 * poll(2) on the event pipe. An arming fires once; any byte means "look again". */
static void wait_seqno(struct queue *q, uint64_t seqno)
{
	for (int spin = 0; spin < 1000; spin++)
		if (__atomic_load_n(word(q->ring, ACCEL_RING_COMPLETED), __ATOMIC_ACQUIRE) >= seqno)
			return;
	for (;;) {
		if (__atomic_load_n(word(db, ACCEL_DB_LOST), __ATOMIC_ACQUIRE)) {
			errno = ENODEV;
			die("context lost");
		}
		__atomic_store_n(word(q->ring, ACCEL_RING_IRQ_SEQNO), seqno, __ATOMIC_SEQ_CST);
		__atomic_thread_fence(__ATOMIC_SEQ_CST); /* store the arming, then load the fence */
		if (__atomic_load_n(word(q->ring, ACCEL_RING_COMPLETED), __ATOMIC_ACQUIRE) >= seqno)
			return;
		struct pollfd p = { .fd = event_r, .events = POLLIN };
		if (poll(&p, 1, 5000) == 0) {
			errno = ETIME;
			die("wait");
		}
		char drain[64];
		while (read(event_r, drain, sizeof(drain)) > 0)
			;
	}
}

int main(int argc, char **argv)
{
	const char *node = argc > 1 ? argv[1] : "/run/accel-emu/dev/accel/accel0";
	dev_fd = open(node, O_RDWR | O_CLOEXEC);
	if (dev_fd < 0)
		die(node);

	struct accel_version ver = { 0 };
	CALL(ACCEL_CMD_GET_VERSION, ver);
	printf("driver ABI %u.%u (header %u.%u), driver %s\n", ver.abi_major, ver.abi_minor,
	       ACCEL_ABI_MAJOR, ACCEL_ABI_MINOR, ver.driver_version);

	struct accel_device_info info = { 0 };
	CALL(ACCEL_CMD_DEVICE_QUERY, info);
	printf("device %u %s, %llu MiB, state %u\n", info.index, info.name,
	       (unsigned long long)(info.memory_total >> 20), info.state);

	/* the context's objects: doorbell pipe (read end to the driver), event pipe (write end
	 * to the driver), doorbell page (a sealed memfd) */
	int bell[2], event[2];
	void *page;
	if (pipe2(bell, O_CLOEXEC | O_NONBLOCK) < 0 || pipe2(event, O_CLOEXEC | O_NONBLOCK) < 0)
		die("pipe2");
	int db_fd = sealed_memfd("doorbell-page", ACCEL_DB_PAGE_SIZE, &page);
	db = page;
	struct accel_ctx_create cc = { .abi_major = ACCEL_ABI_MAJOR, .abi_minor = ACCEL_ABI_MINOR,
				       .doorbell_fd = bell[0], .event_fd = event[1], .db_page_fd = db_fd };
	CALL(ACCEL_CMD_CTX_CREATE, cc);
	close(bell[0]);
	close(event[1]);
	close(db_fd);
	bell_w = bell[1];
	event_r = event[0];
	printf("context %llu\n", (unsigned long long)cc.ctx_id);

	/* memory: device-local, and pinned host memory (a sealed memfd of ours) */
	struct accel_mem_alloc dmem = { .ctx_id = cc.ctx_id, .size = COPY_BYTES,
					.kind = ACCEL_MEM_DEVICE, .fd = -1 };
	CALL(ACCEL_CMD_MEM_ALLOC, dmem);
	void *host;
	int host_fd = sealed_memfd("pinned", 2 * COPY_BYTES, &host);
	struct accel_mem_alloc hmem = { .ctx_id = cc.ctx_id, .size = 2 * COPY_BYTES,
					.kind = ACCEL_MEM_HOST_PINNED, .fd = host_fd };
	CALL(ACCEL_CMD_MEM_ALLOC, hmem);
	close(host_fd);
	printf("memory: device va %#llx, pinned va %#llx\n", (unsigned long long)dmem.va,
	       (unsigned long long)hmem.va);

	/* a queue on a ring of ours */
	struct queue q;
	void *ring;
	int ring_fd = sealed_memfd("ring", ACCEL_RING_FILE_SIZE, &ring);
	struct accel_queue_create qc = { .ctx_id = cc.ctx_id, .priority = ACCEL_QUEUE_PRIORITY_LOW,
					 .ring_fd = ring_fd };
	CALL(ACCEL_CMD_QUEUE_CREATE, qc);
	close(ring_fd);
	q.ring = ring;
	q.slot = qc.doorbell;
	q.id = qc.queue_id;
	printf("queue %llu, doorbell slot %u\n", (unsigned long long)q.id, q.slot);

	/* a no-op through the doorbell, waited for on the event pipe */
	struct accel_packet_nop nop = { .opcode = ACCEL_OP_NOP };
	uint64_t seqno = submit(&q, &nop);
	wait_seqno(&q, seqno);
	printf("noop %llu completed at %llu ns\n", (unsigned long long)seqno,
	       (unsigned long long)*word(q.ring, ACCEL_RING_TIMESTAMPS + 8 * ((seqno - 1) % ACCEL_RING_SLOTS)));

	/* a copy there and back: pinned[0..1 MiB) -> device -> pinned[1..2 MiB) */
	unsigned char *bytes = host;
	for (size_t i = 0; i < COPY_BYTES; i++)
		bytes[i] = (unsigned char)(i * 7 + 3);
	struct accel_packet_copy up = { .opcode = ACCEL_OP_COPY, .dst = dmem.va, .src = hmem.va,
					.nbytes = COPY_BYTES };
	struct accel_packet_copy down = { .opcode = ACCEL_OP_COPY, .dst = hmem.va + COPY_BYTES,
					  .src = dmem.va, .nbytes = COPY_BYTES };
	submit(&q, &up);
	seqno = submit(&q, &down);
	wait_seqno(&q, seqno);
	if (*word(q.ring, ACCEL_RING_ERROR_SEQNO)) {
		fprintf(stderr, "raw_client: the copy faulted: errno %llu\n",
			(unsigned long long)(*word(q.ring, ACCEL_RING_ERROR_CODE) & 0xffffffffu));
		return 1;
	}
	if (memcmp(bytes, bytes + COPY_BYTES, COPY_BYTES)) {
		fprintf(stderr, "raw_client: the copy came back different\n");
		return 1;
	}
	printf("copy of %u bytes there and back ok\n", COPY_BYTES);

	/* a refused command, and the driver's reason for it */
	struct accel_mem_alloc bad = { .ctx_id = cc.ctx_id, .size = 4096, .kind = 9, .fd = -1 };
	int err = call(ACCEL_CMD_MEM_ALLOC, &bad, sizeof(bad));
	char reason[ACCEL_LAST_ERROR_MAX + 1];
	ssize_t n = pread(dev_fd, reason, ACCEL_LAST_ERROR_MAX, ACCEL_LAST_ERROR_OFFSET);
	reason[n > 0 ? n : 0] = 0;
	printf("refused: %s; reason: %s", strerror(err), reason);

	struct accel_queue_destroy qd = { .ctx_id = cc.ctx_id, .queue_id = q.id };
	CALL(ACCEL_CMD_QUEUE_DESTROY, qd);
	struct accel_mem_free f1 = { .ctx_id = cc.ctx_id, .handle = dmem.handle };
	struct accel_mem_free f2 = { .ctx_id = cc.ctx_id, .handle = hmem.handle };
	CALL(ACCEL_CMD_MEM_FREE, f1);
	CALL(ACCEL_CMD_MEM_FREE, f2);
	struct accel_ctx_destroy cd = { .ctx_id = cc.ctx_id };
	CALL(ACCEL_CMD_CTX_DESTROY, cd);
	close(dev_fd);
	printf("done\n");
	return 0;
}
