/*
 * Amending a cgroup's device program (cgroup v2; see cgroup_bpf.h and spank/README.md, "Devices
 * under cgroup v2").
 *
 * Under cgroup v2 a device is allowed by whatever eBPF program of type BPF_PROG_TYPE_CGROUP_DEVICE
 * is in effect for the opening process's cgroup. The kernel's rules (kernel/bpf/cgroup.c,
 * compute_effective_progs, hierarchy_allows_attach and __cgroup_bpf_attach):
 *   - a cgroup runs its own program if it has one, else its nearest ancestor's; a program of a
 *     further ancestor runs as well only if it was attached with BPF_F_ALLOW_MULTI; all that run
 *     must allow (AND);
 *   - attaching is refused below a program attached without BPF_F_ALLOW_OVERRIDE (or MULTI), and
 *     where the cgroup already has a program attached with other flags; attaching a non-MULTI
 *     program where one with the same flags exists replaces it atomically.
 * So a program of our own cannot add a permission anywhere but on the cgroup itself, and there it
 * must decide everything the program it replaces decided: it is a copy of that program (its
 * translated instructions, which for a device program are the original ones: the verifier rewrites
 * no context access of this type: kernel/bpf/cgroup.c, cgroup_dev_is_valid_access) behind a
 * prefix that allows the given devices and otherwise falls through to the copy. Jumps are relative,
 * so prepending moves nothing; the prefix uses R2 only, which the copy cannot read before it writes
 * it (the verifier refuses a read of an uninitialised register), and leaves R1, the context, as is.
 *
 * Slurm's programs (src/plugins/cgroup/v2/ebpf.c, load_ebpf_prog, Slurm 22.05 to 26.05) use no
 * helper and no map; a program that does cannot be copied from its translated form (helper calls and
 * map references are rewritten there) and is refused.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/magic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cgroup_bpf.h"

/* Components below the cgroup2 root: Slurm's deepest is SLICE/SCOPE/JOB/step_S/user/task_T. */
#define MAX_DEPTH 32
/* Programs one query takes back; more than one at a level is refused anyway. */
#define MAX_QUERY_IDS 8
/* Reading the program in effect again when it changed under us (a new step's slurmstepd replacing
   the job-level program: src/plugins/cgroup/v2/cgroup_v2.c, cgroup_p_constrain_apply). */
#define READ_ATTEMPTS 3
/* The prefix: type check (3), then per device a major and a minor check and "return 1" (6). */
#define PREFIX_LEN(n) (3 + 6 * (n))

/* The v1 controllers the kernel has; a v1 mount naming none of them is a named hierarchy (name=systemd). */
static const char *const v1_controllers[] = {
	"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "blkio",
	"perf_event", "net_prio", "hugetlb", "pids", "rdma", "misc", NULL,
};

static bool is_v1_controller(const char *opt)
{
	for (size_t i = 0; v1_controllers[i]; i++) {
		if (strcmp(opt, v1_controllers[i]) == 0)
			return true;
	}
	return false;
}

enum cgroup_devctl cgroup_device_control(const char *mounts_path, struct cgroup_mounts *m)
{
	FILE *f = fopen(mounts_path, "re");
	char *line = NULL;
	size_t cap = 0;

	memset(m, 0, sizeof(*m));
	if (f) {
		while (getline(&line, &cap, f) > 0) {
			char dev[64], dir[PATH_MAX], type[32], opts[1024];

			if (sscanf(line, "%63s %4095s %31s %1023s", dev, dir, type, opts) != 4)
				continue;
			if (strcmp(type, "cgroup2") == 0) {
				if (!m->v2[0])
					snprintf(m->v2, sizeof(m->v2), "%s", dir);
				continue;
			}
			if (strcmp(type, "cgroup") != 0)
				continue;
			for (char *save = NULL, *tok = strtok_r(opts, ",", &save); tok;
			     tok = strtok_r(NULL, ",", &save)) {
				if (!is_v1_controller(tok))
					continue;
				m->v1_controllers = true;
				if (strcmp(tok, "devices") == 0 && !m->v1_devices[0])
					snprintf(m->v1_devices, sizeof(m->v1_devices), "%s", dir);
			}
		}
		free(line);
		fclose(f);
	}
	if (m->v1_devices[0])
		return CGROUP_DEVCTL_V1;
	if (m->v2[0])
		return m->v1_controllers ? CGROUP_DEVCTL_HYBRID : CGROUP_DEVCTL_UNIFIED;
	return CGROUP_DEVCTL_NONE;
}

const char *cgroup_devctl_name(enum cgroup_devctl c)
{
	switch (c) {
	case CGROUP_DEVCTL_V1:
		return "v1";
	case CGROUP_DEVCTL_UNIFIED:
		return "unified";
	case CGROUP_DEVCTL_HYBRID:
		return "hybrid";
	case CGROUP_DEVCTL_NONE:
		break;
	}
	return "none";
}

int cgroup_pid_v2_path(pid_t pid, char *buf, size_t len, bool *unified_only, const char **cause)
{
	char path[64];
	char *line = NULL;
	size_t cap = 0;
	bool found = false;
	FILE *f;

	*unified_only = true;
	snprintf(path, sizeof(path), "/proc/%d/cgroup", (int)pid);
	f = fopen(path, "re");
	if (!f) {
		*cause = "cannot read the /proc/PID/cgroup of the task";
		return -1;
	}
	while (getline(&line, &cap, f) > 0) {
		line[strcspn(line, "\n")] = '\0';
		if (strncmp(line, "0::", 3) != 0) {
			/* "N:CONTROLLERS:PATH": held by a v1 controller, unless it is a named hierarchy only */
			char *ctrls = strchr(line, ':'), *end = ctrls ? strchr(ctrls + 1, ':') : NULL;

			if (end) {
				*end = '\0';
				for (char *save = NULL, *tok = strtok_r(ctrls + 1, ",", &save); tok;
				     tok = strtok_r(NULL, ",", &save))
					*unified_only = *unified_only && !is_v1_controller(tok);
			}
			continue;
		}
		if (!found && snprintf(buf, len, "%s", line + 3) < (int)len)
			found = true;
	}
	free(line);
	fclose(f);
	if (!found) {
		*cause = "the task is in no cgroup v2 cgroup";
		errno = ENOENT;
		return -1;
	}
	return 0;
}

static int sys_bpf(enum bpf_cmd cmd, union bpf_attr *attr)
{
	return (int)syscall(__NR_bpf, cmd, attr, sizeof(*attr));
}

static __u64 ptr_u64(const void *p)
{
	return (__u64)(uintptr_t)p;
}

/* The open cgroup directories from the cgroup2 root (fd[0]) down to the cgroup itself (fd[depth]). */
struct walk {
	int fd[MAX_DEPTH + 1];
	size_t depth;
};

static void walk_close(struct walk *w)
{
	int saved = errno;

	for (size_t i = 0; i <= w->depth; i++) {
		if (w->fd[i] >= 0)
			close(w->fd[i]);
	}
	w->depth = 0;
	w->fd[0] = -1;
	errno = saved;
}

/*
 * Opens mount and each component of path below it, never following a symlink: the path comes
 * from the kernel (/proc/PID/cgroup), but a directory that is not what it names must not receive
 * a program. "." and ".." and empty components are refused.
 */
static int walk_open(const char *mount, const char *path, struct walk *w, const char **cause)
{
	struct statfs st;
	const char *p = path;

	w->depth = 0;
	w->fd[0] = open(mount, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (w->fd[0] < 0) {
		*cause = "cannot open the cgroup2 mount";
		return -1;
	}
	if (fstatfs(w->fd[0], &st) < 0 || st.f_type != CGROUP2_SUPER_MAGIC) {
		*cause = "the cgroup2 mount point is not a cgroup2 file system";
		errno = EINVAL;
		walk_close(w);
		return -1;
	}
	if (p[0] != '/') {
		*cause = "the cgroup path is not absolute";
		errno = EINVAL;
		walk_close(w);
		return -1;
	}
	while (*++p) {
		char name[NAME_MAX + 1];
		size_t n = strcspn(p, "/");

		if (n == 0 || n > NAME_MAX || (n == 1 && p[0] == '.') || (n == 2 && p[0] == '.' && p[1] == '.')) {
			*cause = "the cgroup path has an empty, . or .. component";
			errno = EINVAL;
			walk_close(w);
			return -1;
		}
		if (w->depth == MAX_DEPTH) {
			*cause = "the cgroup path is too deep";
			errno = ELOOP;
			walk_close(w);
			return -1;
		}
		memcpy(name, p, n);
		name[n] = '\0';
		w->fd[w->depth + 1] = openat(w->fd[w->depth], name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (w->fd[w->depth + 1] < 0) {
			*cause = "cannot open the cgroup directory";
			walk_close(w);
			return -1;
		}
		w->depth++;
		p += n;
		if (!*p)
			break;
	}
	return 0;
}

/* The device programs attached at fd (query_flags 0) or in effect there (BPF_F_QUERY_EFFECTIVE). */
static int query(int fd, __u32 query_flags, __u32 *attach_flags, __u32 *ids, __u32 *cnt)
{
	union bpf_attr a;

	memset(&a, 0, sizeof(a));
	a.query.target_fd = (__u32)fd;
	a.query.attach_type = BPF_CGROUP_DEVICE;
	a.query.query_flags = query_flags;
	a.query.prog_ids = ptr_u64(ids);
	a.query.prog_cnt = MAX_QUERY_IDS;
	/* ENOSPC: more than MAX_QUERY_IDS; prog_cnt then holds the total, which is all we need */
	if (sys_bpf(BPF_PROG_QUERY, &a) < 0 && errno != ENOSPC)
		return -1;
	*attach_flags = a.query.attach_flags;
	*cnt = a.query.prog_cnt;
	return 0;
}

/* The program in effect for the walk's cgroup, and how ours must be attached to replace it there. */
struct in_effect {
	__u32 id;
	__u32 attach_flags; /* the flags to attach ours with: the cgroup's own program's, else 0 */
};

/*
 * Finds the one program in effect for w's cgroup: its own, else its nearest ancestor's. 1 found,
 * 0 none (nothing confines the cgroup), -1 with *cause for a state this does not amend.
 */
static int find_in_effect(const struct walk *w, struct in_effect *e, const char **cause)
{
	__u32 ids[MAX_QUERY_IDS], flags, cnt, eff_ids[MAX_QUERY_IDS], eff_cnt;
	bool found = false;
	size_t level = 0;

	for (size_t i = w->depth + 1; i-- > 0;) {
		if (query(w->fd[i], 0, &flags, ids, &cnt) < 0) {
			*cause = "BPF_PROG_QUERY refused";
			return -1;
		}
		if (cnt == 0)
			continue;
		/* A MULTI program runs beside the one in effect below it, and a copy of ours cannot replace it. */
		if (flags & BPF_F_ALLOW_MULTI) {
			*cause = "a device program attached with BPF_F_ALLOW_MULTI applies to the cgroup";
			errno = EEXIST;
			return -1;
		}
		if (found)
			continue; /* overridden by the one found below it */
		if (cnt > 1) {
			*cause = "more than one device program attached where the one in effect is";
			errno = EEXIST;
			return -1;
		}
		found = true;
		level = i;
		e->id = ids[0];
		e->attach_flags = flags;
	}
	if (!found) {
		*cause = "nothing to do: no device program confines the cgroup";
		return 0;
	}
	if (level < w->depth) {
		/* An ancestor's program: ours goes below it, which it must allow (hierarchy_allows_attach). */
		if (!(e->attach_flags & BPF_F_ALLOW_OVERRIDE)) {
			*cause = "the device program in effect is attached to an ancestor without BPF_F_ALLOW_OVERRIDE";
			errno = EPERM;
			return -1;
		}
		e->attach_flags = 0; /* as Slurm attaches at task_N: nothing goes below a task */
	}
	/* The kernel's own answer must agree: exactly that one program runs for the cgroup. */
	if (query(w->fd[w->depth], BPF_F_QUERY_EFFECTIVE, &flags, eff_ids, &eff_cnt) < 0) {
		*cause = "BPF_PROG_QUERY (effective) refused";
		return -1;
	}
	if (eff_cnt != 1 || eff_ids[0] != e->id) {
		*cause = "the device programs in effect changed while they were read";
		errno = EAGAIN;
		return -1;
	}
	return 1;
}

static int prog_info(int prog_fd, struct bpf_prog_info *info)
{
	union bpf_attr a;

	memset(&a, 0, sizeof(a));
	a.info.bpf_fd = (__u32)prog_fd;
	a.info.info_len = sizeof(*info);
	a.info.info = ptr_u64(info);
	return sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &a);
}

/*
 * Whether the translated instructions can be loaded again as they are: no helper call or map
 * reference (both rewritten in the translated form), no register beyond R10 (constant blinding's
 * scratch register).
 */
static bool copyable(const struct bpf_insn *insns, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		__u8 code = insns[i].code;

		if (insns[i].dst_reg > BPF_REG_10 || insns[i].src_reg > BPF_REG_10)
			return false;
		if (BPF_CLASS(code) == BPF_JMP && BPF_OP(code) == BPF_CALL) /* tail calls show as calls */
			return false;
		if (code == (BPF_LD | BPF_IMM | BPF_DW)) {
			if (insns[i].src_reg != 0)
				return false;
			i++; /* the second half of the 64-bit immediate */
		}
	}
	return true;
}

/* The translated instructions of program id into *insns (malloc'd), room left for prefix instructions. */
static int read_program(__u32 id, size_t prefix, struct bpf_insn **insns, size_t *n, const char **cause)
{
	struct bpf_prog_info info;
	union bpf_attr a;
	struct bpf_insn *buf;
	__u32 len;
	int fd, saved;

	memset(&a, 0, sizeof(a));
	a.prog_id = id;
	fd = sys_bpf(BPF_PROG_GET_FD_BY_ID, &a);
	if (fd < 0) {
		if (errno == ENOENT) {
			*cause = "the device programs in effect changed while they were read";
			errno = EAGAIN;
		} else {
			*cause = "BPF_PROG_GET_FD_BY_ID refused";
		}
		return -1;
	}
	memset(&info, 0, sizeof(info));
	if (prog_info(fd, &info) < 0) {
		*cause = "BPF_OBJ_GET_INFO_BY_FD refused";
		goto fail;
	}
	if (info.type != BPF_PROG_TYPE_CGROUP_DEVICE) {
		*cause = "the program in effect is not a device program";
		errno = EINVAL;
		goto fail;
	}
	len = info.xlated_prog_len;
	if (len == 0 || len % sizeof(struct bpf_insn) != 0) {
		*cause = "the instructions of the device program in effect are unreadable";
		errno = EACCES;
		goto fail;
	}
	*n = len / sizeof(struct bpf_insn);
	if (*n > BPF_MAXINSNS - prefix) {
		*cause = "the device program in effect is too large to amend";
		errno = E2BIG;
		goto fail;
	}
	buf = calloc(prefix + *n, sizeof(*buf));
	if (!buf) {
		*cause = "out of memory";
		goto fail;
	}
	memset(&info, 0, sizeof(info));
	info.xlated_prog_len = len;
	info.xlated_prog_insns = ptr_u64(buf + prefix);
	if (prog_info(fd, &info) < 0) {
		*cause = "BPF_OBJ_GET_INFO_BY_FD refused";
		goto fail_buf;
	}
	/* The kernel clears the pointer where it will not show the instructions (a blinded program). */
	if (info.xlated_prog_insns == 0 || info.xlated_prog_len != len) {
		*cause = "the instructions of the device program in effect are unreadable";
		errno = EACCES;
		goto fail_buf;
	}
	if (!copyable(buf + prefix, *n)) {
		*cause = "the device program in effect uses helpers or maps and cannot be copied";
		errno = EINVAL;
		goto fail_buf;
	}
	close(fd);
	*insns = buf;
	return 0;
fail_buf:
	saved = errno;
	free(buf);
	errno = saved;
fail:
	saved = errno;
	close(fd);
	errno = saved;
	return -1;
}

static struct bpf_insn insn(__u8 code, __u8 dst, __u8 src, __s16 off, __s32 imm)
{
	return (struct bpf_insn){.code = code, .dst_reg = dst, .src_reg = src, .off = off, .imm = imm};
}

/*
 * The prefix, in out[0 .. PREFIX_LEN(n)):
 *     r2 = ctx->access_type; r2 &= 0xffff; if r2 != BPF_DEVCG_DEV_CHAR goto copy
 *     for each device: r2 = ctx->major; if r2 != MAJOR goto next
 *                      r2 = ctx->minor; if r2 != MINOR goto next
 *                      r0 = 1; exit
 *   copy: (the program in effect)
 * ctx is struct bpf_cgroup_dev_ctx {access_type, major, minor}, each a u32; the access (high 16
 * bits of access_type) is not looked at: the device is allowed for read, write and mknod.
 */
static void build_prefix(struct bpf_insn *out, const struct cgroup_dev *devs, size_t n)
{
	size_t k = 0;

	out[k++] = insn(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_2, BPF_REG_1, offsetof(struct bpf_cgroup_dev_ctx, access_type), 0);
	out[k++] = insn(BPF_ALU64 | BPF_AND | BPF_K, BPF_REG_2, 0, 0, 0xffff);
	out[k++] = insn(BPF_JMP | BPF_JNE | BPF_K, BPF_REG_2, 0, (__s16)(6 * n), BPF_DEVCG_DEV_CHAR);
	for (size_t i = 0; i < n; i++) {
		out[k++] = insn(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_2, BPF_REG_1, offsetof(struct bpf_cgroup_dev_ctx, major), 0);
		out[k++] = insn(BPF_JMP | BPF_JNE | BPF_K, BPF_REG_2, 0, 4, (__s32)devs[i].major);
		out[k++] = insn(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_2, BPF_REG_1, offsetof(struct bpf_cgroup_dev_ctx, minor), 0);
		out[k++] = insn(BPF_JMP | BPF_JNE | BPF_K, BPF_REG_2, 0, 2, (__s32)devs[i].minor);
		out[k++] = insn(BPF_ALU64 | BPF_MOV | BPF_K, BPF_REG_0, 0, 0, 1);
		out[k++] = insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0);
	}
}

static int load_and_attach(int cgroup_fd, __u32 attach_flags, const struct bpf_insn *insns, size_t n,
			   const char **cause)
{
	union bpf_attr a;
	int prog_fd, saved;

	memset(&a, 0, sizeof(a));
	a.prog_type = BPF_PROG_TYPE_CGROUP_DEVICE;
	a.insns = ptr_u64(insns);
	a.insn_cnt = (__u32)n;
	a.license = ptr_u64("GPL");
	/* the name bpftool and BPF_OBJ_GET_INFO_BY_FD show: [A-Za-z0-9_.], at most 15 characters */
	memcpy(a.prog_name, "antman_devices", sizeof("antman_devices"));
	prog_fd = sys_bpf(BPF_PROG_LOAD, &a);
	if (prog_fd < 0) {
		*cause = "BPF_PROG_LOAD refused";
		return -1;
	}
	memset(&a, 0, sizeof(a));
	a.target_fd = (__u32)cgroup_fd;
	a.attach_bpf_fd = (__u32)prog_fd;
	a.attach_type = BPF_CGROUP_DEVICE;
	a.attach_flags = attach_flags;
	if (sys_bpf(BPF_PROG_ATTACH, &a) < 0) {
		*cause = "BPF_PROG_ATTACH refused";
		saved = errno;
		close(prog_fd);
		errno = saved;
		return -1;
	}
	/* The attachment holds the program now; it goes with the cgroup. */
	close(prog_fd);
	return 0;
}

int cgroup_bpf_allow(const char *mount, const char *path, const struct cgroup_dev *devs, size_t n,
		     const char **cause)
{
	struct walk w;
	struct in_effect e = {0, 0};
	struct bpf_insn *insns = NULL;
	size_t n_insns = 0;
	int rc = -1;

	if (n == 0 || n > CGROUP_BPF_MAX_DEVICES) {
		*cause = n ? "too many devices" : "no devices";
		errno = EINVAL;
		return -1;
	}
	for (size_t i = 0; i < n; i++) {
		if (devs[i].major > INT32_MAX || devs[i].minor > INT32_MAX) {
			*cause = "device number out of range";
			errno = EINVAL;
			return -1;
		}
	}
	if (walk_open(mount, path, &w, cause) < 0)
		return -1;
	/* The job-level program may be replaced while it is read (a new step starting): read it again. */
	for (int attempt = 0; attempt < READ_ATTEMPTS; attempt++) {
		rc = find_in_effect(&w, &e, cause);
		if (rc > 0)
			rc = read_program(e.id, PREFIX_LEN(n), &insns, &n_insns, cause) == 0 ? 1 : -1;
		if (rc >= 0 || errno != EAGAIN)
			break;
	}
	if (rc > 0) {
		build_prefix(insns, devs, n);
		if (load_and_attach(w.fd[w.depth], e.attach_flags, insns, PREFIX_LEN(n) + n_insns, cause) < 0)
			rc = -1;
	}
	free(insns);
	walk_close(&w);
	return rc;
}

int cgroup_bpf_confined(const char *mount, const char *path, const char **cause)
{
	struct walk w;
	__u32 ids[MAX_QUERY_IDS], flags, cnt;
	int rc;

	if (walk_open(mount, path, &w, cause) < 0)
		return -1;
	rc = query(w.fd[w.depth], BPF_F_QUERY_EFFECTIVE, &flags, ids, &cnt);
	if (rc < 0)
		*cause = "BPF_PROG_QUERY (effective) refused";
	walk_close(&w);
	return rc < 0 ? -1 : cnt > 0;
}
