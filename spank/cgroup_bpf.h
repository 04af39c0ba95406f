/*
 * Device programs of the cgroup v2 hierarchy: what a node's device control is, and amending the
 * eBPF program (BPF_PROG_TYPE_CGROUP_DEVICE) in effect for one cgroup so that it also allows a few
 * char devices. No Slurm in here (no spank.h, no logging): each function returns -1 with a short
 * fixed cause (and errno where a system call failed) for its caller to log, so the test driver
 * (tests/c/bpf_grant_driver.c) links this file alone.
 *
 * The design and the kernel rules it relies on: spank/README.md, "Devices under cgroup v2".
 */
#ifndef ANTMAN_CGROUP_BPF_H
#define ANTMAN_CGROUP_BPF_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#ifndef ANTMAN_INTERNAL /* common.h's, without pulling in spank.h */
#define ANTMAN_INTERNAL __attribute__((visibility("hidden")))
#endif

/* The most devices one grant takes: a node's GPUs, with room to spare. */
#define CGROUP_BPF_MAX_DEVICES 64

struct cgroup_dev {
	unsigned major;
	unsigned minor;
};

/* Who controls devices on this node. */
enum cgroup_devctl {
	CGROUP_DEVCTL_NONE,	/* no v1 devices controller, no cgroup2 hierarchy */
	CGROUP_DEVCTL_V1,	/* a v1 hierarchy holds the devices controller (cgroup2 may be mounted beside it) */
	CGROUP_DEVCTL_UNIFIED,	/* cgroup2 and no v1 controller at all: device programs (eBPF) */
	CGROUP_DEVCTL_HYBRID,	/* v1 controllers, none of them devices, and cgroup2 beside them (e.g. .../unified) */
};

struct cgroup_mounts {
	char v1_devices[PATH_MAX]; /* the v1 devices hierarchy's mount point, "" when none */
	char v2[PATH_MAX];	   /* the first cgroup2 mount point, "" when none */
	bool v1_controllers;	   /* some v1 hierarchy holds a controller (a named one like name=systemd does not count) */
};

/*
 * Reads the mount table (mounts_path: /proc/self/mounts, or a file in its format for a test) into m
 * and says what controls devices. A table that cannot be read counts as empty (CGROUP_DEVCTL_NONE).
 */
ANTMAN_INTERNAL enum cgroup_devctl cgroup_device_control(const char *mounts_path, struct cgroup_mounts *m);

/* "none", "v1", "unified", "hybrid". */
ANTMAN_INTERNAL const char *cgroup_devctl_name(enum cgroup_devctl c);

/*
 * The cgroup2 path of pid ("/system.slice/...", the "0::" line of /proc/PID/cgroup) into buf;
 * *unified_only tells whether no v1 controller holds the process (no other line, or only named
 * hierarchies such as "1:name=systemd:/...").
 * Returns 0, or -1 with *cause when the file is unreadable or has no "0::" line.
 */
ANTMAN_INTERNAL int cgroup_pid_v2_path(pid_t pid, char *buf, size_t len, bool *unified_only, const char **cause);

/*
 * Allows the char devices devs (any access) to the processes of the cgroup at path (as
 * /proc/PID/cgroup spells it) under the cgroup2 mount point mount, by attaching to that cgroup a copy
 * of the device program in effect there with a prefix that returns "allow" for exactly those devices.
 * The path is opened component by component without following symlinks; "." and ".." are refused.
 * Returns 1 when the amended program is attached; 0 when no device program is in effect there
 * (nothing confines the cgroup's devices: nothing to do; *cause says so); -1 with *cause (and
 * errno) when anything is not as expected or a system call fails: nothing was attached then.
 */
ANTMAN_INTERNAL int cgroup_bpf_allow(const char *mount, const char *path, const struct cgroup_dev *devs, size_t n,
				     const char **cause);

/*
 * Whether a device program is in effect for the cgroup at path: 1 yes, 0 no, -1 with *cause (the
 * path cannot be opened, the kernel cannot be asked).
 */
ANTMAN_INTERNAL int cgroup_bpf_confined(const char *mount, const char *path, const char **cause);

#endif /* ANTMAN_CGROUP_BPF_H */
