/*
 * Preloaded into a clone's QEMU (LD_PRELOAD) by tine. Two jobs, both small.
 *
 * 1. A userfaultfd for write tracking. A userfaultfd belongs to the
 *    address space of the process that creates it, and only QEMU can
 *    create one for its own. The constructor makes one before QEMU's
 *    main() runs (so before its seccomp filter) and leaves it open. tine
 *    takes a copy with pidfd_getfd(2), negotiates UFFD_FEATURE_WP_ASYNC,
 *    registers the guest RAM mapping and asks PAGEMAP_SCAN which pages the
 *    guest wrote (crates/vmm/src/ram/tracker.rs). If the call fails, QEMU
 *    runs as without it and tine compares pages instead.
 *
 * 2. Guarding the shared RAM file ($TINE_SHIM_RAM, the clone's mem-path)
 *    so the balloon can give freed guest pages back. A clone maps that
 *    file MAP_PRIVATE, and every clone of the snapshot maps the same file.
 *    QEMU discards a reported free page with fallocate(PUNCH_HOLE) on the
 *    file, then madvise(MADV_DONTNEED) on the mapping; it refuses both if
 *    it opened the file read-only. So QEMU is told the file is writable
 *    (readonly=off), and here:
 *    - its open of that path is made O_RDONLY, so nothing in QEMU can
 *      change the file (the kernel refuses writes and fallocate on such a
 *      descriptor; the jail also binds it read-only);
 *    - a PUNCH_HOLE fallocate on that file succeeds without doing
 *      anything, so QEMU goes on to MADV_DONTNEED, which drops the clone's
 *      private copy of the page: the memory goes back to the host, and the
 *      page reads the snapshot's content again (a free page's content is
 *      not the guest's concern: it zeroes pages it allocates).
 *    tine checks, before the guest runs, that QEMU holds the file only
 *    read-only (crates/vmm/src/shim.rs).
 *
 * The two meet in madvise: dropping a write-protected page leaves a
 * protection marker, which reads as "not written", yet the page now reads
 * the snapshot's content and may differ from what the last capture saw.
 * So before MADV_DONTNEED the range's protection is lifted: a dropped page
 * then has no page table entry at all, which tine's scan looks for. (If
 * tine tracks nothing, that call fails harmlessly; if it fails otherwise,
 * the discard is refused.)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#ifndef FALLOC_FL_PUNCH_HOLE
#define FALLOC_FL_PUNCH_HOLE 0x02
#endif

/* The userfaultfd made here (-1: none). */
static int uffd = -1;

/* The guarded file's path, and its identity once opened (0: not yet). */
static char *guard_path;
static dev_t guard_dev;
static ino_t guard_ino;

__attribute__((constructor)) static void tine_shim_init(void)
{
    /* User-mode-only faults are all an asynchronous write-protect needs,
     * and they do not require vm.unprivileged_userfaultfd. */
    uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);

    const char *p = getenv("TINE_SHIM_RAM");
    if (p && *p)
        guard_path = strdup(p);
}

/* The flags to open `path` with: read-only if it is the guarded file. */
static int guarded_flags(const char *path, int flags)
{
    if (guard_path && path && strcmp(path, guard_path) == 0)
        return (flags & ~(O_ACCMODE | O_CREAT | O_TRUNC | O_EXCL)) | O_RDONLY;
    return flags;
}

static void remember(int fd, const char *path)
{
    struct stat st;
    if (fd >= 0 && guard_path && strcmp(path, guard_path) == 0 && fstat(fd, &st) == 0) {
        guard_dev = st.st_dev;
        guard_ino = st.st_ino;
    }
}

typedef int (*open_fn)(const char *, int, ...);

static int do_open(const char *path, int flags, mode_t mode)
{
    static open_fn real_open;
    if (!real_open)
        real_open = (open_fn)dlsym(RTLD_NEXT, "open64");
    if (!real_open) {
        errno = ENOSYS;
        return -1;
    }
    int fd = real_open(path, guarded_flags(path, flags), mode);
    remember(fd, path);
    return fd;
}

static mode_t mode_arg(int flags, va_list ap)
{
    if (flags & (O_CREAT | __O_TMPFILE))
        return (mode_t)va_arg(ap, int);
    return 0;
}

int open64(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    return do_open(path, flags, mode);
}

int open(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    return do_open(path, flags, mode);
}

/* The _FORTIFY_SOURCE entry points (no mode argument). */
int __open64_2(const char *path, int flags)
{
    return do_open(path, flags, 0);
}

int __open_2(const char *path, int flags)
{
    return do_open(path, flags, 0);
}

static int is_guarded_fd(int fd)
{
    struct stat st;
    return guard_ino != 0 && fstat(fd, &st) == 0 && st.st_dev == guard_dev &&
           st.st_ino == guard_ino;
}

typedef int (*fallocate_fn)(int, int, off_t, off_t);

static int do_fallocate(int fd, int mode, off_t offset, off_t len)
{
    if ((mode & FALLOC_FL_PUNCH_HOLE) && is_guarded_fd(fd))
        return 0;
    static fallocate_fn real_fallocate;
    if (!real_fallocate)
        real_fallocate = (fallocate_fn)dlsym(RTLD_NEXT, "fallocate64");
    if (!real_fallocate) {
        errno = ENOSYS;
        return -1;
    }
    return real_fallocate(fd, mode, offset, len);
}

int fallocate64(int fd, int mode, off_t offset, off_t len)
{
    return do_fallocate(fd, mode, offset, len);
}

int fallocate(int fd, int mode, off_t offset, off_t len)
{
    return do_fallocate(fd, mode, offset, len);
}

typedef int (*madvise_fn)(void *, size_t, int);

int madvise(void *addr, size_t len, int advice)
{
    static madvise_fn real_madvise;
    if (!real_madvise)
        real_madvise = (madvise_fn)dlsym(RTLD_NEXT, "madvise");
    if (!real_madvise) {
        errno = ENOSYS;
        return -1;
    }
    if (advice == MADV_DONTNEED && uffd >= 0) {
        /* Lift the protection first: a page dropped with it would keep a
         * marker that reads as "not written". ENOENT: the range is not
         * tracked; EINVAL: nothing is tracked (tine never set the uffd
         * up). Anything else: refuse the discard, so the page stays as
         * it is (QEMU reports the failure and goes on). */
        struct uffdio_writeprotect wp = {
            .range = { .start = (unsigned long)addr, .len = len },
            .mode = 0,
        };
        int r, tries = 0;
        do {
            r = ioctl(uffd, UFFDIO_WRITEPROTECT, &wp);
        } while (r < 0 && errno == EAGAIN && ++tries < 100);
        if (r < 0 && errno != ENOENT && errno != EINVAL)
            return -1;
    }
    return real_madvise(addr, len, advice);
}
