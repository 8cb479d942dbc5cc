/* faultfs: a preloaded library that fails libc's file calls on matching paths with a chosen errno, and shifts the
 * wall clock: the disk faults and clock faults of tests/faults.py, raised where real ones come from (the libc call
 * every library's I/O goes through: Python's, TensorStore's file driver, ArrayRecord's reader).
 *
 * Rules, from the environment variable JAXTRAIN_FAULTFS at load, or faultfs_configure() at any time:
 *   OPS:SUBSTRING:ERRNO:SKIP:TIMES[;...]    OPS: '|'-joined of open read write sync rename unlink mkdir list
 *   clock:SECONDS                            CLOCK_REALTIME shifted by SECONDS (a float, may be negative)
 * A call whose path (for read/write/sync: the path the descriptor was opened with) contains SUBSTRING fails with
 * ERRNO, after SKIP matching calls have passed, TIMES times (-1: for good). faultfs_fired(i) counts rule i's failures.
 * Built by tests/faults.py with the system's C compiler: cc -shared -fPIC -O2 -o faultfs.so faultfs.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { OP_OPEN = 1, OP_READ = 2, OP_WRITE = 4, OP_SYNC = 8, OP_RENAME = 16, OP_UNLINK = 32, OP_MKDIR = 64, OP_LIST = 128 };

#define MAX_RULES 32
#define MAX_FDS 65536

typedef struct {
  int ops;
  char substring[512];
  int err;
  long skip;
  long times;
  long seen;
  long fired;
} rule_t;

static rule_t rules[MAX_RULES];
static int n_rules = 0;
static volatile int active = 0;
static double clock_offset = 0.0;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char *fd_paths[MAX_FDS];

static int parse_ops(const char *s) {
  int ops = 0;
  if (strstr(s, "open")) ops |= OP_OPEN;
  if (strstr(s, "read")) ops |= OP_READ;
  if (strstr(s, "write")) ops |= OP_WRITE;
  if (strstr(s, "sync")) ops |= OP_SYNC;
  if (strstr(s, "rename")) ops |= OP_RENAME;
  if (strstr(s, "unlink")) ops |= OP_UNLINK;
  if (strstr(s, "mkdir")) ops |= OP_MKDIR;
  if (strstr(s, "list")) ops |= OP_LIST;
  return ops;
}

int faultfs_configure(const char *spec) {
  pthread_mutex_lock(&lock);
  n_rules = 0;
  clock_offset = 0.0;
  if (spec != NULL) {
    char *copy = strdup(spec), *save = NULL;
    for (char *item = strtok_r(copy, ";", &save); item != NULL && n_rules < MAX_RULES;
         item = strtok_r(NULL, ";", &save)) {
      if (strncmp(item, "clock:", 6) == 0) {
        clock_offset = atof(item + 6);
        continue;
      }
      /* OPS:SUBSTRING:ERRNO:SKIP:TIMES, the substring may hold no ':' */
      char ops[128] = {0};
      rule_t r = {0};
      if (sscanf(item, "%127[^:]:%511[^:]:%d:%ld:%ld", ops, r.substring, &r.err, &r.skip, &r.times) == 5) {
        r.ops = parse_ops(ops);
        rules[n_rules++] = r;
      }
    }
    free(copy);
  }
  active = n_rules > 0 || clock_offset != 0.0;
  pthread_mutex_unlock(&lock);
  return n_rules;
}

long faultfs_fired(int i) {
  long fired;
  pthread_mutex_lock(&lock);
  fired = (i >= 0 && i < n_rules) ? rules[i].fired : -1;
  pthread_mutex_unlock(&lock);
  return fired;
}

__attribute__((constructor)) static void faultfs_init(void) { faultfs_configure(getenv("JAXTRAIN_FAULTFS")); }

/* 0, or the errno the call fails with. */
static int should_fail(int op, const char *path) {
  if (!active || path == NULL) return 0;
  int err = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < n_rules; i++) {
    rule_t *r = &rules[i];
    if (!(r->ops & op) || strstr(path, r->substring) == NULL) continue;
    r->seen++;
    if (r->seen <= r->skip || (r->times >= 0 && r->fired >= r->times)) continue;
    r->fired++;
    err = r->err;
    break;
  }
  pthread_mutex_unlock(&lock);
  return err;
}

static const char *fd_path(int fd) { return (fd >= 0 && fd < MAX_FDS) ? fd_paths[fd] : NULL; }

static void remember(int fd, int dirfd, const char *path) {
  if (fd < 0 || fd >= MAX_FDS || path == NULL) return;
  char *full;
  const char *dir = (path[0] != '/' && dirfd >= 0) ? fd_path(dirfd) : NULL;
  if (dir != NULL) {
    if (asprintf(&full, "%s/%s", dir, path) < 0) return;
  } else {
    full = strdup(path);
  }
  pthread_mutex_lock(&lock);
  char *old = fd_paths[fd];
  fd_paths[fd] = full;
  pthread_mutex_unlock(&lock);
  free(old);
}

static void forget(int fd) {
  if (fd < 0 || fd >= MAX_FDS || fd_paths[fd] == NULL) return;
  pthread_mutex_lock(&lock);
  char *old = fd_paths[fd];
  fd_paths[fd] = NULL;
  pthread_mutex_unlock(&lock);
  free(old);
}

#define REAL(name, ret, ...)                                    \
  static ret (*real_##name)(__VA_ARGS__) = NULL;                \
  if (real_##name == NULL) real_##name = dlsym(RTLD_NEXT, #name);

#define FAIL_IF(op, path, value)      \
  do {                                \
    int e_ = should_fail(op, path);   \
    if (e_) {                         \
      errno = e_;                     \
      return value;                   \
    }                                 \
  } while (0)

static mode_t mode_of(int flags, va_list ap) {
  return (flags & O_CREAT) || (flags & __O_TMPFILE) == __O_TMPFILE ? (mode_t)va_arg(ap, int) : 0;
}

#define OPEN_LIKE(name)                                          \
  int name(const char *path, int flags, ...) {                   \
    REAL(name, int, const char *, int, ...);                     \
    va_list ap;                                                  \
    va_start(ap, flags);                                         \
    mode_t mode = mode_of(flags, ap);                            \
    va_end(ap);                                                  \
    FAIL_IF(OP_OPEN, path, -1);                                  \
    int fd = real_##name(path, flags, mode);                     \
    remember(fd, -1, path);                                      \
    return fd;                                                   \
  }
OPEN_LIKE(open)
OPEN_LIKE(open64)

#define OPENAT_LIKE(name)                                        \
  int name(int dirfd, const char *path, int flags, ...) {        \
    REAL(name, int, int, const char *, int, ...);                \
    va_list ap;                                                  \
    va_start(ap, flags);                                         \
    mode_t mode = mode_of(flags, ap);                            \
    va_end(ap);                                                  \
    FAIL_IF(OP_OPEN, path, -1);                                  \
    int fd = real_##name(dirfd, path, flags, mode);              \
    remember(fd, dirfd, path);                                   \
    return fd;                                                   \
  }
OPENAT_LIKE(openat)
OPENAT_LIKE(openat64)

int __open_2(const char *path, int flags) { return open(path, flags); }
int __open64_2(const char *path, int flags) { return open64(path, flags); }
int __openat_2(int dirfd, const char *path, int flags) { return openat(dirfd, path, flags); }
int __openat64_2(int dirfd, const char *path, int flags) { return openat64(dirfd, path, flags); }

int creat(const char *path, mode_t mode) { return open(path, O_CREAT | O_WRONLY | O_TRUNC, mode); }
int creat64(const char *path, mode_t mode) { return open64(path, O_CREAT | O_WRONLY | O_TRUNC, mode); }

int close(int fd) {
  REAL(close, int, int);
  forget(fd);
  return real_close(fd);
}

ssize_t read(int fd, void *buf, size_t n) {
  REAL(read, ssize_t, int, void *, size_t);
  FAIL_IF(OP_READ, fd_path(fd), -1);
  return real_read(fd, buf, n);
}

ssize_t pread(int fd, void *buf, size_t n, off_t off) {
  REAL(pread, ssize_t, int, void *, size_t, off_t);
  FAIL_IF(OP_READ, fd_path(fd), -1);
  return real_pread(fd, buf, n, off);
}

ssize_t pread64(int fd, void *buf, size_t n, off64_t off) {
  REAL(pread64, ssize_t, int, void *, size_t, off64_t);
  FAIL_IF(OP_READ, fd_path(fd), -1);
  return real_pread64(fd, buf, n, off);
}

ssize_t readv(int fd, const struct iovec *iov, int n) {
  REAL(readv, ssize_t, int, const struct iovec *, int);
  FAIL_IF(OP_READ, fd_path(fd), -1);
  return real_readv(fd, iov, n);
}

ssize_t preadv(int fd, const struct iovec *iov, int n, off_t off) {
  REAL(preadv, ssize_t, int, const struct iovec *, int, off_t);
  FAIL_IF(OP_READ, fd_path(fd), -1);
  return real_preadv(fd, iov, n, off);
}

ssize_t preadv64(int fd, const struct iovec *iov, int n, off64_t off) {
  REAL(preadv64, ssize_t, int, const struct iovec *, int, off64_t);
  FAIL_IF(OP_READ, fd_path(fd), -1);
  return real_preadv64(fd, iov, n, off);
}

ssize_t write(int fd, const void *buf, size_t n) {
  REAL(write, ssize_t, int, const void *, size_t);
  FAIL_IF(OP_WRITE, fd_path(fd), -1);
  return real_write(fd, buf, n);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
  REAL(pwrite, ssize_t, int, const void *, size_t, off_t);
  FAIL_IF(OP_WRITE, fd_path(fd), -1);
  return real_pwrite(fd, buf, n, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off64_t off) {
  REAL(pwrite64, ssize_t, int, const void *, size_t, off64_t);
  FAIL_IF(OP_WRITE, fd_path(fd), -1);
  return real_pwrite64(fd, buf, n, off);
}

ssize_t writev(int fd, const struct iovec *iov, int n) {
  REAL(writev, ssize_t, int, const struct iovec *, int);
  FAIL_IF(OP_WRITE, fd_path(fd), -1);
  return real_writev(fd, iov, n);
}

ssize_t pwritev(int fd, const struct iovec *iov, int n, off_t off) {
  REAL(pwritev, ssize_t, int, const struct iovec *, int, off_t);
  FAIL_IF(OP_WRITE, fd_path(fd), -1);
  return real_pwritev(fd, iov, n, off);
}

ssize_t pwritev64(int fd, const struct iovec *iov, int n, off64_t off) {
  REAL(pwritev64, ssize_t, int, const struct iovec *, int, off64_t);
  FAIL_IF(OP_WRITE, fd_path(fd), -1);
  return real_pwritev64(fd, iov, n, off);
}

int fsync(int fd) {
  REAL(fsync, int, int);
  FAIL_IF(OP_SYNC, fd_path(fd), -1);
  return real_fsync(fd);
}

int fdatasync(int fd) {
  REAL(fdatasync, int, int);
  FAIL_IF(OP_SYNC, fd_path(fd), -1);
  return real_fdatasync(fd);
}

int rename(const char *from, const char *to) {
  REAL(rename, int, const char *, const char *);
  FAIL_IF(OP_RENAME, from, -1);
  FAIL_IF(OP_RENAME, to, -1);
  return real_rename(from, to);
}

int renameat(int fromfd, const char *from, int tofd, const char *to) {
  REAL(renameat, int, int, const char *, int, const char *);
  FAIL_IF(OP_RENAME, from, -1);
  FAIL_IF(OP_RENAME, to, -1);
  return real_renameat(fromfd, from, tofd, to);
}

int renameat2(int fromfd, const char *from, int tofd, const char *to, unsigned int flags) {
  REAL(renameat2, int, int, const char *, int, const char *, unsigned int);
  FAIL_IF(OP_RENAME, from, -1);
  FAIL_IF(OP_RENAME, to, -1);
  return real_renameat2(fromfd, from, tofd, to, flags);
}

int unlink(const char *path) {
  REAL(unlink, int, const char *);
  FAIL_IF(OP_UNLINK, path, -1);
  return real_unlink(path);
}

int unlinkat(int dirfd, const char *path, int flags) {
  REAL(unlinkat, int, int, const char *, int);
  FAIL_IF(OP_UNLINK, path, -1);
  return real_unlinkat(dirfd, path, flags);
}

int rmdir(const char *path) {
  REAL(rmdir, int, const char *);
  FAIL_IF(OP_UNLINK, path, -1);
  return real_rmdir(path);
}

int mkdir(const char *path, mode_t mode) {
  REAL(mkdir, int, const char *, mode_t);
  FAIL_IF(OP_MKDIR, path, -1);
  return real_mkdir(path, mode);
}

int mkdirat(int dirfd, const char *path, mode_t mode) {
  REAL(mkdirat, int, int, const char *, mode_t);
  FAIL_IF(OP_MKDIR, path, -1);
  return real_mkdirat(dirfd, path, mode);
}

DIR *opendir(const char *path) {
  REAL(opendir, DIR *, const char *);
  FAIL_IF(OP_LIST, path, NULL);
  return real_opendir(path);
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
  REAL(clock_gettime, int, clockid_t, struct timespec *);
  int r = real_clock_gettime(clock, ts);
  if (r == 0 && active && clock_offset != 0.0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
    double t = (double)ts->tv_sec + ts->tv_nsec * 1e-9 + clock_offset;
    ts->tv_sec = (time_t)t;
    ts->tv_nsec = (long)((t - (double)ts->tv_sec) * 1e9);
  }
  return r;
}
