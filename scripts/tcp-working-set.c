// The kernel's own loopback TCP at a given working set: what iperf3 does (one stream, blocking
// send() of BLOCK bytes until TOTAL bytes, the receiver recv()s into BLOCK-sized slots), except
// that each side cycles over a buffer of WS bytes instead of one BLOCK-sized buffer. With WS =
// BLOCK it is iperf3's case (the buffers stay in cache); with WS = TOTAL it moves the bytes
// `te-bench transfer` moves (a fresh 256 MiB on each side, cold in cache).
//
//   gcc -O2 -o /tmp/tcp-working-set scripts/tcp-working-set.c
//   /tmp/tcp-working-set BLOCK TOTAL WS      e.g. 1048576 268435456 1048576
//
// Prints the receiver's GB/s from its first byte to its last.
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *buffer(size_t ws) {
  // Mapped and touched after fork, so neither side copies-on-write the other's pages.
  char *b = mmap(0, ws, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (b == MAP_FAILED) exit(3);
  memset(b, 7, ws);
  return b;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s BLOCK TOTAL WS\n", argv[0]);
    return 1;
  }
  size_t block = strtoull(argv[1], 0, 0), total = strtoull(argv[2], 0, 0), ws = strtoull(argv[3], 0, 0);
  if (!block || ws % block) {
    fprintf(stderr, "WS must be a multiple of BLOCK\n");
    return 1;
  }
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  if (bind(ls, (void *)&a, sizeof a) || listen(ls, 1) || getsockname(ls, (void *)&a, &al)) return 1;
  pid_t p = fork();
  if (p == 0) {
    char *buf = buffer(ws);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void *)&a, sizeof a)) return 1;
    for (size_t sent = 0; sent < total;) {
      ssize_t n = send(s, buf + sent % ws, block - sent % block, 0);
      if (n <= 0) return 2;
      sent += n;
    }
    close(s);
    return 0;
  }
  char *buf = buffer(ws);
  int c = accept(ls, 0, 0);
  size_t got = 0;
  double t0 = 0;
  while (got < total) {
    ssize_t n = recv(c, buf + got % ws, block - got % block, 0);
    if (n <= 0) break;
    if (!got) t0 = now();
    got += n;
  }
  double t = now() - t0;
  waitpid(p, 0, 0);
  printf("%.3f GB/s block %zu ws %zu bytes %zu\n", got / t / 1e9, block, ws, got);
  return got == total ? 0 : 4;
}
