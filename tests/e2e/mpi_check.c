/* An Open MPI job of 2 ranks that checks what it moved: a ping-pong of growing messages (rank
 * 1 returns each one with every byte incremented) and an MPI_Allreduce of per-rank vectors.
 * Prints "mpi_check: ok" on rank 0 and exits 0 when both are right, then each rank the time its
 * MPI_Finalize took; built by mpi_ucx.sh. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int ping_pong(int rank) {
  enum { kMax = 1 << 20, kRounds = 20 };
  unsigned char* buf = malloc(kMax);
  int bad = 0;
  for (int len = 1; len <= kMax; len *= 4) {
    for (int r = 0; r < kRounds; ++r) {
      if (rank == 0) {
        for (int i = 0; i < len; ++i) buf[i] = (unsigned char)(i * 7 + r + len);
        MPI_Send(buf, len, MPI_BYTE, 1, r, MPI_COMM_WORLD);
        MPI_Recv(buf, len, MPI_BYTE, 1, r, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        for (int i = 0; i < len; ++i) {
          if (buf[i] != (unsigned char)(i * 7 + r + len + 1)) {
            fprintf(stderr, "mpi_check: ping-pong of %d bytes, round %d: byte %d is %u\n", len, r,
                    i, buf[i]);
            bad = 1;
            break;
          }
        }
      } else {
        MPI_Recv(buf, len, MPI_BYTE, 0, r, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        for (int i = 0; i < len; ++i) ++buf[i];
        MPI_Send(buf, len, MPI_BYTE, 0, r, MPI_COMM_WORLD);
      }
    }
  }
  free(buf);
  return bad;
}

static int allreduce(int rank, int size) {
  enum { kCount = 100000 };
  long* in = malloc(kCount * sizeof(long));
  long* out = malloc(kCount * sizeof(long));
  int bad = 0;
  for (int i = 0; i < kCount; ++i) in[i] = (long)i * (rank + 1);
  MPI_Allreduce(in, out, kCount, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  const long factor = (long)size * (size + 1) / 2; /* sum of rank + 1 */
  for (int i = 0; i < kCount; ++i) {
    if (out[i] != (long)i * factor) {
      fprintf(stderr, "mpi_check: rank %d: allreduce element %d is %ld, not %ld\n", rank, i, out[i],
              (long)i * factor);
      bad = 1;
      break;
    }
  }
  free(in);
  free(out);
  return bad;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    if (rank == 0) fprintf(stderr, "mpi_check: needs 2 ranks, has %d\n", size);
    MPI_Finalize();
    return 2;
  }
  int bad = ping_pong(rank) | allreduce(rank, size);
  int any_bad = 0;
  MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && !any_bad) printf("mpi_check: ok\n");
  fflush(stdout);
  /* How long MPI_Finalize takes: a transport that waits for retries shows here (seconds). */
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  MPI_Finalize();
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("mpi_check: rank %d finalize %.3f s\n", rank,
         (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
  return any_bad;
}
