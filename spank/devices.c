/*
 * An opportunistic job's GPUs in the devices cgroup (see devices.h). Called from task_post_fork:
 * slurmstepd is root there, Slurm has already written its own device rules into the job's, the
 * step's and the task's cgroups, and the task has not exec'd the user's program yet.
 *
 * Nothing here trusts the job: the cgroup path comes from the kernel (/proc/PID/cgroup of a task
 * slurmstepd just forked; only root may move a process between cgroups) and must be this job's
 * own (uid_UID/job_JOBID from slurmstepd's items); the devices come from the root-owned env file
 * the Prolog wrote; every path is opened without following symlinks.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "devices.h"
#include "envfile.h"

#define MAX_DEVICES 64
#define MAX_CGROUP_DEPTH 4 /* job_J / step_S / task_T, and one level to spare */
#define DEVICES_VALUE_MAX 1024

struct device {
	unsigned major;
	unsigned minor;
};

/* "195:0,195:3" into devices; -1 on anything else (the file is root's, but a typo must not grant). */
static int parse_devices(const char *value, struct device *out, size_t *n)
{
	const char *p = value;

	*n = 0;
	while (*p) {
		char *end;
		unsigned long major, minor;

		if (*n == MAX_DEVICES || !isdigit((unsigned char)*p))
			return -1;
		major = strtoul(p, &end, 10);
		if (*end != ':' || !isdigit((unsigned char)end[1]) || major > 4095)
			return -1;
		minor = strtoul(end + 1, &end, 10);
		if ((*end != ',' && *end != '\0') || minor > 1048575)
			return -1;
		out[(*n)++] = (struct device){(unsigned)major, (unsigned)minor};
		p = *end == ',' ? end + 1 : end;
	}
	return *n ? 0 : -1;
}

/* The devices hierarchy's mount point (cgroup v1); "" when there is none (cgroup v2, or no controller). */
static void devices_mount(char *buf, size_t len)
{
	FILE *f = fopen("/proc/self/mounts", "re");
	char *line = NULL;
	size_t cap = 0;

	buf[0] = '\0';
	if (!f)
		return;
	while (getline(&line, &cap, f) > 0) {
		char dev[64], dir[PATH_MAX], type[32], opts[512];

		if (sscanf(line, "%63s %4095s %31s %511s", dev, dir, type, opts) != 4 || strcmp(type, "cgroup") != 0)
			continue;
		for (char *save = NULL, *tok = strtok_r(opts, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
			if (strcmp(tok, "devices") == 0) {
				snprintf(buf, len, "%s", dir);
				goto out;
			}
		}
	}
out:
	free(line);
	fclose(f);
}

/* The task's devices cgroup path ("/slurm_node1/uid_0/job_4/step_batch/task_0"); -1 when it has none. */
static int task_devices_cgroup(pid_t pid, char *buf, size_t len)
{
	char path[64];
	char *line = NULL;
	size_t cap = 0;
	int rc = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/cgroup", (int)pid);
	f = fopen(path, "re");
	if (!f)
		return -1;
	while (rc < 0 && getline(&line, &cap, f) > 0) {
		char *ctrl = strchr(line, ':');
		char *cg = ctrl ? strchr(ctrl + 1, ':') : NULL;

		if (!cg)
			continue;
		*cg++ = '\0';
		cg[strcspn(cg, "\n")] = '\0';
		for (char *save = NULL, *tok = strtok_r(ctrl + 1, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
			if (strcmp(tok, "devices") == 0 && snprintf(buf, len, "%s", cg) < (int)len) {
				rc = 0;
				break;
			}
		}
	}
	free(line);
	fclose(f);
	return rc;
}

/*
 * Checks that cgroup is /ROOT/uid_UID/job_JOBID/... with ROOT "slurm" or "slurm_NODE" (Slurm's
 * layout; the node is in it where several slurmd share a host), and splits it: job_dir gets
 * "ROOT/uid_UID/job_JOBID", node the NODE part or "".
 */
static int job_cgroup(const char *cgroup, uid_t uid, uint32_t job_id, char *job_dir, size_t job_len,
		      char *node, size_t node_len)
{
	char want[64];
	const char *root = cgroup + 1, *slash;
	size_t root_len;

	if (cgroup[0] != '/' || !(slash = strchr(root, '/')))
		return -1;
	root_len = (size_t)(slash - root);
	if (!((root_len == 5 && strncmp(root, "slurm", 5) == 0) ||
	      (root_len > 6 && strncmp(root, "slurm_", 6) == 0)))
		return -1;
	for (size_t i = 0; i < root_len; i++) {
		unsigned char c = (unsigned char)root[i];
		if (!(isalnum(c) || c == '_' || c == '-' || c == '.'))
			return -1;
	}
	snprintf(want, sizeof(want), "/uid_%u/job_%u", (unsigned)uid, job_id);
	if (strncmp(slash, want, strlen(want)) != 0 || (slash[strlen(want)] != '/' && slash[strlen(want)] != '\0'))
		return -1;
	if (snprintf(job_dir, job_len, "%.*s%s", (int)root_len, root, want) >= (int)job_len)
		return -1;
	if (root_len > 6)
		snprintf(node, node_len, "%.*s", (int)(root_len - 6), root + 6);
	else
		node[0] = '\0';
	return 0;
}

static int allow_in(int dirfd, const char *where, const struct device *devs, size_t n)
{
	int fd = openat(dirfd, "devices.allow", O_WRONLY | O_NOFOLLOW | O_CLOEXEC);

	if (fd < 0) {
		slurm_error("antman: cannot open %s/devices.allow: %m", where);
		return -1;
	}
	for (size_t i = 0; i < n; i++) {
		char rule[48];
		int len = snprintf(rule, sizeof(rule), "c %u:%u rwm", devs[i].major, devs[i].minor);

		if (write(fd, rule, (size_t)len) != len) {
			slurm_error("antman: cannot allow c %u:%u in %s: %m", devs[i].major, devs[i].minor, where);
			close(fd);
			return -1;
		}
	}
	close(fd);
	return 0;
}

/* Allows devs in dirfd's cgroup, then in every cgroup below it: a child may hold no more than its parent. */
static int allow_tree(int dirfd, const char *where, const struct device *devs, size_t n, int depth)
{
	struct dirent *de;
	DIR *dir;
	int rc = 0, fd;

	if (allow_in(dirfd, where, devs, n) < 0)
		return -1;
	if (depth >= MAX_CGROUP_DEPTH)
		return 0;
	fd = dup(dirfd);
	if (fd < 0 || !(dir = fdopendir(fd))) {
		if (fd >= 0)
			close(fd);
		slurm_error("antman: cannot list %s: %m", where);
		return -1;
	}
	while (rc == 0 && (de = readdir(dir))) {
		char sub[PATH_MAX];
		int subfd;

		if (de->d_type != DT_DIR || de->d_name[0] == '.')
			continue;
		subfd = openat(dirfd, de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (subfd < 0)
			continue; /* a step ending meanwhile removes its cgroup */
		snprintf(sub, sizeof(sub), "%s/%s", where, de->d_name);
		rc = allow_tree(subfd, sub, devs, n, depth + 1);
		close(subfd);
	}
	closedir(dir);
	return rc;
}

int antman_devices_grant(uint32_t job_id, uid_t uid, pid_t task_pid)
{
	char mount[PATH_MAX], cgroup[PATH_MAX], job_dir[PATH_MAX], node[256], where[PATH_MAX * 2];
	char value[DEVICES_VALUE_MAX];
	struct device devs[MAX_DEVICES];
	size_t n;
	int rc, dirfd;

	devices_mount(mount, sizeof(mount));
	if (!mount[0]) {
		/* No cgroup v1 devices controller: with cgroup/v2 Slurm's device rules are eBPF programs,
		   which this does not amend. Say so where an admin looks, for the job it would hurt. */
		if (env_file_value(job_id, NULL, ANTMAN_ENV_GPU_DEVICES, value, sizeof(value)) > 0)
			slurm_info("antman: job %u: no cgroup v1 devices controller on this node; if Slurm confines "
				   "devices here (cgroup/v2), the job cannot open its GPU(s) %s", job_id, value);
		return 0;
	}
	if (task_devices_cgroup(task_pid, cgroup, sizeof(cgroup)) < 0)
		return 0; /* the task is in no devices cgroup: nothing was taken away */
	if (job_cgroup(cgroup, uid, job_id, job_dir, sizeof(job_dir), node, sizeof(node)) < 0) {
		/* Not under Slurm's job cgroup: ConstrainDevices is off, so nothing was taken away. */
		slurm_debug("antman: job %u task %d is in devices cgroup %s, not Slurm's job cgroup; nothing to allow",
			    job_id, (int)task_pid, cgroup);
		return 0;
	}
	rc = env_file_value(job_id, node[0] ? node : NULL, ANTMAN_ENV_GPU_DEVICES, value, sizeof(value));
	if (rc <= 0)
		return rc; /* 0: no placed devices (a guaranteed or plain job: Slurm's own rules stand) */
	if (parse_devices(value, devs, &n) < 0) {
		slurm_error("antman: job %u: %s=%s in its env file is not MAJOR:MINOR[,MAJOR:MINOR...]; no GPU allowed",
			    job_id, ANTMAN_ENV_GPU_DEVICES, value);
		return -1;
	}
	snprintf(where, sizeof(where), "%s/%s", mount, job_dir);
	dirfd = open(where, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (dirfd < 0) {
		slurm_error("antman: job %u: cannot open its devices cgroup %s: %m", job_id, where);
		return -1;
	}
	rc = allow_tree(dirfd, where, devs, n, 0);
	close(dirfd);
	if (rc == 0)
		slurm_debug("antman: job %u: allowed %s in %s", job_id, value, where);
	return rc;
}
