/*
 * Test driver for spank/cgroup_bpf.c (tests/test_spank_cgroup_bpf.py compiles it with that file).
 * One command per run, one result line (or one per device for probe) on stdout:
 *
 *   devctl MOUNTS_FILE                   what cgroup_device_control() makes of a mount table
 *   pidpath PID                          cgroup_pid_v2_path()
 *   attach DIR none|override|multi slurm|allow-all|big|helper [MINOR]
 *                                        attaches a device program to the cgroup DIR: "slurm" denies
 *                                        c 195:0-3 except c 195:MINOR (the job's own GRES GPU; none
 *                                        when MINOR is -1 or absent) and accepts everything else, as
 *                                        Slurm's programs do; "allow-all" accepts all; "big" is as large
 *                                        as a program may be, less 2; "helper" calls a BPF helper
 *   query DIR                            the programs attached at DIR and in effect there
 *   allow MOUNT PATH MAJ:MIN[,MAJ:MIN]   cgroup_bpf_allow()
 *   confined MOUNT PATH                  cgroup_bpf_confined()
 *   probe DIR FILE...                    forks a child, moves it into the cgroup DIR, and has it open
 *                                        each FILE: "FILE ok" or "FILE ERRNAME"
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cgroup_bpf.h"

#define NVIDIA_MAJOR 195

static int sys_bpf(enum bpf_cmd cmd, union bpf_attr *attr)
{
	return (int)syscall(__NR_bpf, cmd, attr, sizeof(*attr));
}

static const char *errname(int err)
{
	const char *name = strerrorname_np(err);

	return name ? name : "E?";
}

static struct bpf_insn insn(__u8 code, __u8 dst, __u8 src, __s16 off, __s32 imm)
{
	return (struct bpf_insn){.code = code, .dst_reg = dst, .src_reg = src, .off = off, .imm = imm};
}

/* Slurm's shape (src/plugins/cgroup/v2/ebpf.c): type, access, major, minor into R2-R5, then one
   "if it is this device, return accept" block per gres.conf device, then "return 1". */
static size_t slurm_like(struct bpf_insn *p, int job_minor, int allow_all)
{
	size_t k = 0;

	p[k++] = insn(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_2, BPF_REG_1, 0, 0);
	p[k++] = insn(BPF_ALU | BPF_AND | BPF_K, BPF_REG_2, 0, 0, 0xffff);
	p[k++] = insn(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_3, BPF_REG_1, 0, 0);
	p[k++] = insn(BPF_ALU | BPF_RSH | BPF_K, BPF_REG_3, 0, 0, 16);
	p[k++] = insn(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_4, BPF_REG_1, 4, 0);
	p[k++] = insn(BPF_LDX | BPF_MEM | BPF_W, BPF_REG_5, BPF_REG_1, 8, 0);
	for (int minor = 0; !allow_all && minor < 4; minor++) {
		p[k++] = insn(BPF_JMP | BPF_JNE | BPF_K, BPF_REG_2, 0, 4, BPF_DEVCG_DEV_CHAR);
		p[k++] = insn(BPF_JMP | BPF_JNE | BPF_K, BPF_REG_4, 0, 3, NVIDIA_MAJOR);
		p[k++] = insn(BPF_JMP | BPF_JNE | BPF_K, BPF_REG_5, 0, 2, minor);
		p[k++] = insn(BPF_ALU64 | BPF_MOV | BPF_K, BPF_REG_0, 0, 0, minor == job_minor);
		p[k++] = insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0);
	}
	p[k++] = insn(BPF_ALU64 | BPF_MOV | BPF_K, BPF_REG_0, 0, 0, 1);
	p[k++] = insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0);
	return k;
}

/* BPF_MAXINSNS - 2 instructions: no prefix fits in front of it. */
static size_t big(struct bpf_insn *p)
{
	size_t k = 0;

	while (k < BPF_MAXINSNS - 3)
		p[k++] = insn(BPF_ALU64 | BPF_MOV | BPF_K, BPF_REG_0, 0, 0, 1);
	p[k++] = insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0);
	return k;
}

/* Accepts all, after a helper call (bpf_get_prandom_u32, which device programs may call). */
static size_t helper(struct bpf_insn *p)
{
	size_t k = 0;

	p[k++] = insn(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_get_prandom_u32);
	p[k++] = insn(BPF_ALU64 | BPF_MOV | BPF_K, BPF_REG_0, 0, 0, 1);
	p[k++] = insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0);
	return k;
}

static int cmd_attach(int argc, char **argv)
{
	static struct bpf_insn prog[BPF_MAXINSNS];
	union bpf_attr a;
	__u32 flags;
	size_t n;
	int cg, fd;

	if (argc < 5)
		return 2;
	if (strcmp(argv[3], "none") == 0)
		flags = 0;
	else if (strcmp(argv[3], "override") == 0)
		flags = BPF_F_ALLOW_OVERRIDE;
	else if (strcmp(argv[3], "multi") == 0)
		flags = BPF_F_ALLOW_MULTI;
	else
		return 2;
	if (strcmp(argv[4], "big") == 0)
		n = big(prog);
	else if (strcmp(argv[4], "helper") == 0)
		n = helper(prog);
	else
		n = slurm_like(prog, argc > 5 ? atoi(argv[5]) : -1, strcmp(argv[4], "allow-all") == 0);
	cg = open(argv[2], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (cg < 0) {
		printf("error=%s step=open\n", errname(errno));
		return 1;
	}
	memset(&a, 0, sizeof(a));
	a.prog_type = BPF_PROG_TYPE_CGROUP_DEVICE;
	a.insns = (__u64)(uintptr_t)prog;
	a.insn_cnt = (__u32)n;
	a.license = (__u64)(uintptr_t)"GPL";
	memcpy(a.prog_name, "slurm_like", sizeof("slurm_like"));
	fd = sys_bpf(BPF_PROG_LOAD, &a);
	if (fd < 0) {
		printf("error=%s step=load\n", errname(errno));
		return 1;
	}
	memset(&a, 0, sizeof(a));
	a.target_fd = (__u32)cg;
	a.attach_bpf_fd = (__u32)fd;
	a.attach_type = BPF_CGROUP_DEVICE;
	a.attach_flags = flags;
	if (sys_bpf(BPF_PROG_ATTACH, &a) < 0) {
		printf("error=%s step=attach\n", errname(errno));
		return 1;
	}
	printf("attached\n");
	return 0;
}

static int query(int cg, __u32 query_flags, __u32 *attach_flags, __u32 *ids, __u32 *cnt)
{
	union bpf_attr a;

	memset(&a, 0, sizeof(a));
	a.query.target_fd = (__u32)cg;
	a.query.attach_type = BPF_CGROUP_DEVICE;
	a.query.query_flags = query_flags;
	a.query.prog_ids = (__u64)(uintptr_t)ids;
	a.query.prog_cnt = *cnt;
	if (sys_bpf(BPF_PROG_QUERY, &a) < 0)
		return -1;
	*attach_flags = a.query.attach_flags;
	*cnt = a.query.prog_cnt;
	return 0;
}

/* "own=N flags=F effective=M name=NAME ids=ID,ID effective_ids=ID,ID" (NAME: the first own program's, or -). */
static int cmd_query(int argc, char **argv)
{
	__u32 ids[16], eff[16], flags, eff_flags, cnt = 16, eff_cnt = 16;
	char name[BPF_OBJ_NAME_LEN + 1] = "-";
	int cg;

	if (argc < 3)
		return 2;
	cg = open(argv[2], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (cg < 0 || query(cg, 0, &flags, ids, &cnt) < 0 ||
	    query(cg, BPF_F_QUERY_EFFECTIVE, &eff_flags, eff, &eff_cnt) < 0) {
		printf("error=%s\n", errname(errno));
		return 1;
	}
	if (cnt > 0) {
		struct bpf_prog_info info;
		union bpf_attr a;
		int fd;

		memset(&a, 0, sizeof(a));
		a.prog_id = ids[0];
		fd = sys_bpf(BPF_PROG_GET_FD_BY_ID, &a);
		memset(&info, 0, sizeof(info));
		memset(&a, 0, sizeof(a));
		a.info.bpf_fd = (__u32)fd;
		a.info.info_len = sizeof(info);
		a.info.info = (__u64)(uintptr_t)&info;
		if (fd >= 0 && sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &a) == 0)
			snprintf(name, sizeof(name), "%s", info.name);
	}
	printf("own=%u flags=%u effective=%u name=%s ids=", cnt, flags, eff_cnt, name);
	for (__u32 i = 0; i < cnt && i < 16; i++)
		printf("%s%u", i ? "," : "", ids[i]);
	printf(" effective_ids=");
	for (__u32 i = 0; i < eff_cnt && i < 16; i++)
		printf("%s%u", i ? "," : "", eff[i]);
	printf("\n");
	return 0;
}

static int cmd_allow(int argc, char **argv)
{
	struct cgroup_dev devs[CGROUP_BPF_MAX_DEVICES];
	const char *cause = "";
	size_t n = 0;
	int rc;

	if (argc < 5)
		return 2;
	for (char *save = NULL, *tok = strtok_r(argv[4], ",", &save); tok && n < CGROUP_BPF_MAX_DEVICES;
	     tok = strtok_r(NULL, ",", &save)) {
		if (sscanf(tok, "%u:%u", &devs[n].major, &devs[n].minor) != 2)
			return 2;
		n++;
	}
	errno = 0;
	rc = cgroup_bpf_allow(argv[2], argv[3], devs, n, &cause);
	printf("rc=%d errno=%s cause=%s\n", rc, rc < 0 ? errname(errno) : "-", rc == 1 ? "" : cause);
	return 0;
}

static int cmd_probe(int argc, char **argv)
{
	int go[2], status;
	pid_t pid;
	char buf[4096];
	int fd, len;

	if (argc < 4 || pipe(go) < 0)
		return 2;
	fflush(stdout);
	pid = fork();
	if (pid < 0)
		return 1;
	if (pid == 0) {
		char c;

		close(go[1]);
		if (read(go[0], &c, 1) != 1)
			_exit(3); /* the parent could not move it: open nothing */
		for (int i = 3; i < argc; i++) {
			int dev = open(argv[i], O_RDWR | O_CLOEXEC);

			if (dev >= 0) {
				printf("%s ok\n", argv[i]);
				close(dev);
			} else {
				printf("%s %s\n", argv[i], errname(errno));
			}
		}
		fflush(stdout);
		_exit(0);
	}
	close(go[0]);
	snprintf(buf, sizeof(buf), "%s/cgroup.procs", argv[2]);
	fd = open(buf, O_WRONLY | O_CLOEXEC);
	len = snprintf(buf, sizeof(buf), "%d", (int)pid);
	if (fd < 0 || write(fd, buf, (size_t)len) != len) {
		printf("error=%s step=move\n", errname(errno));
		kill(pid, SIGKILL);
		waitpid(pid, &status, 0);
		return 1;
	}
	close(fd);
	if (write(go[1], "g", 1) != 1) {
		kill(pid, SIGKILL);
		waitpid(pid, &status, 0);
		return 1;
	}
	close(go[1]);
	if (waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
		return 1;
	return 0;
}

int main(int argc, char **argv)
{
	const char *cause = "";

	if (argc < 3)
		return 2;
	if (strcmp(argv[1], "devctl") == 0) {
		struct cgroup_mounts m;
		enum cgroup_devctl c = cgroup_device_control(argv[2], &m);

		printf("devctl=%s v1_devices=%s v2=%s v1_controllers=%d\n", cgroup_devctl_name(c),
		       m.v1_devices[0] ? m.v1_devices : "-", m.v2[0] ? m.v2 : "-", m.v1_controllers);
		return 0;
	}
	if (strcmp(argv[1], "pidpath") == 0) {
		char path[4096];
		bool only;

		if (cgroup_pid_v2_path((pid_t)atoi(argv[2]), path, sizeof(path), &only, &cause) < 0)
			printf("rc=-1 cause=%s\n", cause);
		else
			printf("rc=0 path=%s unified_only=%d\n", path, only);
		return 0;
	}
	if (strcmp(argv[1], "attach") == 0)
		return cmd_attach(argc, argv);
	if (strcmp(argv[1], "query") == 0)
		return cmd_query(argc, argv);
	if (strcmp(argv[1], "allow") == 0)
		return cmd_allow(argc, argv);
	if (strcmp(argv[1], "confined") == 0 && argc >= 4) {
		int rc = cgroup_bpf_confined(argv[2], argv[3], &cause);

		printf("rc=%d cause=%s\n", rc, rc < 0 ? cause : "");
		return 0;
	}
	if (strcmp(argv[1], "probe") == 0)
		return cmd_probe(argc, argv);
	return 2;
}
