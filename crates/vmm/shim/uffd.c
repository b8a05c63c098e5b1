/*
 * Preloaded into a clone's QEMU (LD_PRELOAD) by tine.
 *
 * A userfaultfd belongs to the address space of the process that creates
 * it, and only QEMU can create one for its own. This constructor makes one
 * before QEMU's main() runs (so before its seccomp filter) and leaves it
 * open. tine takes a copy with pidfd_getfd(2), negotiates
 * UFFD_FEATURE_WP_ASYNC, registers the guest RAM mapping and asks
 * PAGEMAP_SCAN which pages the guest wrote (see crates/vmm/src/ram/tracker.rs).
 * The descriptor is not used here, and nothing else is done: if the call
 * fails, QEMU runs as without the shim and tine compares pages instead.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

__attribute__((constructor)) static void tine_uffd_init(void)
{
    /* User-mode-only faults are all an asynchronous write-protect needs,
     * and they do not require vm.unprivileged_userfaultfd. */
    (void)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
}
