/*
 * An opportunistic job's GPUs in its device cgroup (see devices.h). Called from task_post_fork:
 * slurmstepd is root there, Slurm has already set up its own device rules for the job, the step
 * and the task (src/slurmd/slurmstepd/mgr.c, _fork_all_tasks: task_g_pre_launch_priv and
 * task_g_post_set_affinity come before spank_task_post_fork, 22.05 to 26.05), and the task has not
 * exec'd the user's program yet.
 *
 * cgroup v1: devices.allow in the job's, the step's and the task's cgroups (and the rest of the
 * job's tree). cgroup v2: Slurm's rules are eBPF programs, and the task's own cgroup gets a copy of
 * the program in effect for it that also allows the placed GPUs (cgroup_bpf.c; spank/README.md,
 * "Devices under cgroup v2").
 *
 * Nothing here trusts the job: the cgroup path comes from the kernel (/proc/PID/cgroup of a task
 * slurmstepd just forked; only root may move a process between cgroups) and must still have the
 * shape of this job's own; the devices come from the root-owned env file the Prolog wrote; every
 * path is opened without following symlinks. A grant that fails is reported to the caller, which
 * fails the task (fail closed): an opportunistic job must never run without the GPU it was placed
 * on, nor with one it was not.
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
#include <time.h>
#include <unistd.h>

#include "cgroup_bpf.h"
#include "devices.h"
#include "envfile.h"

#define MAX_CGROUP_DEPTH 4 /* job_J / step_S / task_T, and one level to spare */
#define DEVICES_VALUE_MAX 1024
/*
 * cgroup v1: how often the walk from the job's cgroup down to the task's is tried. A new step's
 * slurmstepd rewrites the job-level rules meanwhile (src/plugins/cgroup/v1, the devices constrain
 * of the job cgroup); a deny on a parent removes the exception from every descendant, and a child
 * cannot be allowed what its parent is not, so a write below it fails with EPERM until the walk
 * starts again from the top. Seen under Slurm 24.11 with concurrent steps.
 */
#define V1_ATTEMPTS 5
#define V1_RETRY_MS 10 /* doubled after each attempt */

/* "195:0,195:3" into devices; -1 on anything else (the file is root's, but a typo must not grant). */
static int parse_devices(const char *value, struct cgroup_dev *out, size_t *n)
{
	const char *p = value;

	*n = 0;
	while (*p) {
		char *end;
		unsigned long major, minor;

		if (*n == CGROUP_BPF_MAX_DEVICES || !isdigit((unsigned char)*p))
			return -1;
		major = strtoul(p, &end, 10);
		if (*end != ':' || !isdigit((unsigned char)end[1]) || major > 4095)
			return -1;
		minor = strtoul(end + 1, &end, 10);
		if ((*end != ',' && *end != '\0') || minor > 1048575)
			return -1;
		out[(*n)++] = (struct cgroup_dev){(unsigned)major, (unsigned)minor};
		p = *end == ',' ? end + 1 : end;
	}
	return *n ? 0 : -1;
}

/* "GPU 195:2" or "GPUs 195:2,195:3", from the parsed devices: digits only, whatever the file held. */
static void describe_devices(const struct cgroup_dev *devs, size_t n, char *buf, size_t len)
{
	size_t used = (size_t)snprintf(buf, len, "GPU%s ", n > 1 ? "s" : "");

	for (size_t i = 0; i < n && used < len; i++)
		used += (size_t)snprintf(buf + used, len - used, "%s%u:%u", i ? "," : "", devs[i].major, devs[i].minor);
}

static void sleep_ms(long ms)
{
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

/* ---- cgroup v1: devices.allow ---- */

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

/* Writes "c MAJ:MIN rwm" for each device to dirfd's devices.allow; -1 with errno on the first refusal. */
static int allow_in(int dirfd, const struct cgroup_dev *devs, size_t n)
{
	int fd = openat(dirfd, "devices.allow", O_WRONLY | O_NOFOLLOW | O_CLOEXEC);

	if (fd < 0)
		return -1;
	for (size_t i = 0; i < n; i++) {
		char rule[48];
		int len = snprintf(rule, sizeof(rule), "c %u:%u rwm", devs[i].major, devs[i].minor);

		if (write(fd, rule, (size_t)len) != len) {
			int saved = errno;
			close(fd);
			errno = saved;
			return -1;
		}
	}
	close(fd);
	return 0;
}

/*
 * Whether dirfd's devices.list lets every device be read and written ("c 195:2 rwm", "a *:* rwm", ...).
 * Telling only in a default-deny cgroup, whose list holds the exceptions; a default-allow one (Slurm
 * only writes denies) lists "a *:* rwm" whatever it denies (security/device_cgroup.c, devcgroup_seq_show).
 */
static bool listed(int dirfd, const struct cgroup_dev *devs, size_t n)
{
	int fd = openat(dirfd, "devices.list", O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	FILE *f = fd >= 0 ? fdopen(fd, "re") : NULL;
	char *line = NULL;
	size_t cap = 0;
	bool seen[CGROUP_BPF_MAX_DEVICES] = {false};
	size_t found = 0;

	if (!f) {
		if (fd >= 0)
			close(fd);
		return false;
	}
	while (found < n && getline(&line, &cap, f) > 0) {
		char type, maj[16], min[16], access[8];

		if (sscanf(line, "%c %15[0-9*]:%15[0-9*] %7s", &type, maj, min, access) != 4 ||
		    (type != 'a' && type != 'c') || !strchr(access, 'r') || !strchr(access, 'w'))
			continue;
		for (size_t i = 0; i < n; i++) {
			if (!seen[i] && (maj[0] == '*' || strtoul(maj, NULL, 10) == devs[i].major) &&
			    (min[0] == '*' || strtoul(min, NULL, 10) == devs[i].minor)) {
				seen[i] = true;
				found++;
			}
		}
	}
	free(line);
	fclose(f);
	return found == n;
}

/*
 * Opens rel ("/step_0/task_0", the task's own path below the job's cgroup job_fd) component by
 * component without following symlinks and, with devs, allows them at the job's level and at each
 * level below, top-down: a child may hold no more than its parent. Returns the task cgroup's fd, or
 * -1 with errno (EPERM where a parent did not allow the devices) and *where the cgroup's name.
 */
static int walk_down(int job_fd, const char *job_name, const char *rel, const struct cgroup_dev *devs, size_t n,
		     char *where, size_t where_len)
{
	int fd = dup(job_fd), next;
	const char *p = rel;

	snprintf(where, where_len, "%s", job_name);
	if (fd < 0 || (devs && allow_in(fd, devs, n) < 0))
		goto fail;
	while (*p == '/') {
		char name[NAME_MAX + 1];
		size_t len = strcspn(++p, "/");

		if (len == 0 || len > NAME_MAX || (len == 1 && p[0] == '.') || (len == 2 && p[0] == '.' && p[1] == '.')) {
			errno = EINVAL;
			goto fail;
		}
		memcpy(name, p, len);
		name[len] = '\0';
		snprintf(where, where_len, "%s", name);
		next = openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (next < 0)
			goto fail;
		close(fd);
		fd = next;
		if (devs && allow_in(fd, devs, n) < 0)
			goto fail;
		p += len;
	}
	return fd;
fail:
	if (fd >= 0) {
		int saved = errno;
		close(fd);
		errno = saved;
	}
	return -1;
}

/*
 * Allows devs in every cgroup below dirfd (the job's other steps and tasks), best effort: a new
 * step's slurmstepd rewriting the job-level rules took them away from the steps already running,
 * whose own task_post_fork will not come again. Returns how many cgroups refused.
 */
static int allow_rest(int dirfd, const struct cgroup_dev *devs, size_t n, int depth)
{
	struct dirent *de;
	DIR *dir;
	int refused = 0, fd;

	if (depth >= MAX_CGROUP_DEPTH)
		return 0;
	fd = dup(dirfd);
	if (fd < 0 || !(dir = fdopendir(fd))) {
		if (fd >= 0)
			close(fd);
		return 1;
	}
	while ((de = readdir(dir))) {
		int subfd;

		if (de->d_type != DT_DIR || de->d_name[0] == '.')
			continue;
		subfd = openat(dirfd, de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (subfd < 0)
			continue; /* a step ending meanwhile removes its cgroup */
		if (allow_in(subfd, devs, n) < 0)
			refused += errno != ENOENT && errno != ENODEV;
		else
			refused += allow_rest(subfd, devs, n, depth + 1);
		close(subfd);
	}
	closedir(dir);
	return refused;
}

/*
 * The job's placed devices from its env file on node ("" for the only node directory that has one): 1 with
 * devs, n and what ("GPU 195:2") set, 0 when it has none, -1 with failure set (where: "in cgroup v1", ...).
 */
static int placed_devices(uint32_t job_id, const char *node, const char *where, struct cgroup_dev *devs, size_t *n,
			  char *what, size_t what_len, char *failure, size_t failure_len)
{
	char value[DEVICES_VALUE_MAX];
	int rc = env_file_value(job_id, node[0] ? node : NULL, ANTMAN_ENV_GPU_DEVICES, value, sizeof(value));

	if (rc <= 0) {
		if (rc < 0)
			snprintf(failure, failure_len, "cannot allow its GPUs %s: its env file is unreadable", where);
		return rc;
	}
	if (parse_devices(value, devs, n) < 0) {
		snprintf(failure, failure_len, "cannot allow its GPUs: %s in its env file is not a list of MAJOR:MINOR",
			 ANTMAN_ENV_GPU_DEVICES);
		return -1;
	}
	describe_devices(devs, *n, what, what_len);
	return 1;
}

static int grant_v1(uint32_t job_id, uid_t uid, pid_t task_pid, const char *mount, char *failure, size_t failure_len)
{
	char cgroup[PATH_MAX], job_dir[PATH_MAX], node[256], path[PATH_MAX * 2], where[NAME_MAX + 1];
	char what[DEVICES_VALUE_MAX];
	struct cgroup_dev devs[CGROUP_BPF_MAX_DEVICES];
	const char *job_name, *rel;
	size_t n;
	int rc = -1, job_fd, refused = 0, attempt;

	if (task_devices_cgroup(task_pid, cgroup, sizeof(cgroup)) < 0)
		return 0; /* the task is in no devices cgroup: nothing was taken away */
	if (job_cgroup(cgroup, uid, job_id, job_dir, sizeof(job_dir), node, sizeof(node)) < 0) {
		/* Not under Slurm's job cgroup: ConstrainDevices is off, so nothing was taken away. */
		slurm_debug("antman: job %u task %d is in devices cgroup %s, not Slurm's job cgroup; nothing to allow",
			    job_id, (int)task_pid, cgroup);
		return 0;
	}
	rc = placed_devices(job_id, node, "in cgroup v1", devs, &n, what, sizeof(what), failure, failure_len);
	if (rc <= 0)
		return rc; /* 0: no placed devices (a guaranteed or plain job: Slurm's own rules stand) */
	snprintf(path, sizeof(path), "%s/%s", mount, job_dir);
	job_fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (job_fd < 0) {
		snprintf(failure, failure_len, "cannot allow its %s in cgroup v1: its job cgroup cannot be opened (%s)",
			 what, strerror(errno));
		return -1;
	}
	job_name = strrchr(job_dir, '/') + 1;
	rel = cgroup + 1 + strlen(job_dir);
	for (attempt = 1; attempt <= V1_ATTEMPTS; attempt++) {
		int task_fd = walk_down(job_fd, job_name, rel, devs, n, where, sizeof(where));

		if (task_fd >= 0) {
			bool held;

			refused = allow_rest(job_fd, devs, n, 0);
			/* A concurrent rewrite of the job's rules may have taken the grant away again meanwhile
			   (visible in a default-deny cgroup only). */
			held = listed(task_fd, devs, n);
			close(task_fd);
			if (held) {
				rc = 0;
				break;
			}
			snprintf(where, sizeof(where), "%s", "the task (taken away again)");
			errno = EPERM;
		}
		rc = -1;
		if (errno != EPERM)
			break;
		if (attempt < V1_ATTEMPTS)
			sleep_ms(V1_RETRY_MS << (attempt - 1));
	}
	if (rc < 0) {
		snprintf(failure, failure_len, "cannot allow its %s in cgroup v1: devices.allow of %s refused (%s) after %d tries",
			 what, where, strerror(errno), attempt > V1_ATTEMPTS ? V1_ATTEMPTS : attempt);
	} else {
		if (refused)
			slurm_info("antman: job %u: %s allowed in %s%s, but %d other cgroup(s) of the job refused",
				   job_id, what, mount, cgroup, refused);
		slurm_debug("antman: job %u: allowed %s in %s%s and the job's other cgroups (try %d)", job_id, what,
			    mount, cgroup, attempt);
	}
	close(job_fd);
	return rc;
}

/* ---- cgroup v2: the device program of the task's cgroup ---- */

/* A Slurm SLUID (src/common/sluid.c, sluid2str): "s" and 13 characters of Crockford base32. */
static bool is_sluid(const char *s, size_t len)
{
	if (len != 14 || s[0] != 's')
		return false;
	for (size_t i = 1; i < len; i++) {
		if (!s[i] || !strchr("0123456789ABCDEFGHJKMNPQRSTVWXYZ", s[i]))
			return false;
	}
	return true;
}

/* Whether [s, s+len) is prefix followed by one or more digits (and, with plus, "+DIGITS" after them). */
static bool is_numbered(const char *s, size_t len, const char *prefix, bool plus)
{
	size_t i = strlen(prefix), digits = 0;

	if (len <= i || strncmp(s, prefix, i) != 0)
		return false;
	for (; i < len && isdigit((unsigned char)s[i]); i++)
		digits++;
	if (plus && i < len && s[i] == '+' && digits) {
		digits = 0;
		for (i++; i < len && isdigit((unsigned char)s[i]); i++)
			digits++;
	}
	return digits && i == len;
}

static bool is_step(const char *s, size_t len)
{
	static const char *const names[] = {"step_batch", "step_extern", "step_interactive", NULL};

	for (size_t i = 0; names[i]; i++) {
		if (len == strlen(names[i]) && strncmp(s, names[i], len) == 0)
			return true;
	}
	return is_numbered(s, len, "step_", true); /* step_0, and step_0+1 for a heterogeneous step */
}

/*
 * Checks the shape of the task's cgroup v2 path: it must end in JOB/step_S/user/task_T, JOB being
 * job_JOBID of this job (Slurm up to 25.11, and 26.05 with CgroupJobIdPaths=yes) or a SLUID (26.05,
 * src/plugins/cgroup/v2/cgroup_v2.c). node gets NODE from the nearest NODE_slurmstepd.scope above
 * the job (the scope of one of several slurmd -N NODE on a host), or "" (slurmstepd.scope).
 */
static bool v2_job_cgroup(const char *cgroup, uint32_t job_id, char *node, size_t node_len)
{
	static const char scope[] = "_slurmstepd.scope";
	const char *comp[64];
	size_t len[64], n = 0;
	char want[32];
	int want_len = snprintf(want, sizeof(want), "job_%u", job_id);

	node[0] = '\0';
	for (const char *p = cgroup; *p == '/' && p[1];) {
		if (n == 64)
			return false;
		comp[n] = ++p;
		len[n] = strcspn(p, "/");
		p += len[n++];
	}
	if (n < 4)
		return false;
	for (size_t i = n - 4; i-- > 0;) {
		size_t s = sizeof(scope) - 1;

		if (len[i] > s && strncmp(comp[i] + len[i] - s, scope, s) == 0) {
			for (size_t k = 0; k < len[i] - s; k++) {
				unsigned char c = (unsigned char)comp[i][k];
				if (!(isalnum(c) || c == '_' || c == '-' || c == '.'))
					return false;
			}
			if (len[i] - s < node_len)
				snprintf(node, node_len, "%.*s", (int)(len[i] - s), comp[i]);
			break;
		}
	}
	return ((len[n - 4] == (size_t)want_len && strncmp(comp[n - 4], want, len[n - 4]) == 0) ||
		is_sluid(comp[n - 4], len[n - 4])) &&
	       is_step(comp[n - 3], len[n - 3]) && len[n - 2] == 4 && strncmp(comp[n - 2], "user", 4) == 0 &&
	       is_numbered(comp[n - 1], len[n - 1], "task_", false);
}

static int grant_v2(uint32_t job_id, const char *mount, const char *cgroup, char *failure, size_t failure_len)
{
	char node[256], what[DEVICES_VALUE_MAX];
	struct cgroup_dev devs[CGROUP_BPF_MAX_DEVICES];
	const char *cause = NULL;
	bool shaped = v2_job_cgroup(cgroup, job_id, node, sizeof(node));
	size_t n;
	int rc;

	rc = placed_devices(job_id, node, "on this cgroup v2 node", devs, &n, what, sizeof(what), failure, failure_len);
	if (rc <= 0)
		return rc; /* 0: no placed devices (a guaranteed or plain job: Slurm's own rules stand) */
	if (!shaped) {
		/* Not Slurm's task cgroup: no grant there. Only where no device program confines the task
		   (no task/cgroup, or ConstrainDevices=no) was nothing taken away. */
		if (cgroup_bpf_confined(mount, cgroup, &cause) == 0) {
			slurm_debug("antman: job %u task cgroup %s is not Slurm's and no device program confines it; "
				    "nothing to allow", job_id, cgroup);
			return 0;
		}
		snprintf(failure, failure_len, "cannot allow its %s on this cgroup v2 node: the task is not in a Slurm "
			 "task cgroup (JOB/step_S/user/task_T) of this job", what);
		return -1;
	}
	errno = 0;
	rc = cgroup_bpf_allow(mount, cgroup, devs, n, &cause);
	if (rc < 0) {
		snprintf(failure, failure_len, "cannot allow its %s on this cgroup v2 node: %s (%s)", what, cause,
			 errno ? strerror(errno) : "no error number");
		return -1;
	}
	if (rc == 0)
		slurm_debug("antman: job %u: %s in %s%s", job_id, cause, mount, cgroup);
	else
		slurm_debug("antman: job %u: allowed %s in the device program of %s%s", job_id, what, mount, cgroup);
	return 0;
}

int antman_devices_grant(uint32_t job_id, uid_t uid, pid_t task_pid, char *failure, size_t failure_len)
{
	struct cgroup_mounts m;
	enum cgroup_devctl ctl = cgroup_device_control("/proc/self/mounts", &m);
	char cgroup[PATH_MAX], value[DEVICES_VALUE_MAX];
	const char *cause = NULL;
	bool unified_only = false;

	failure[0] = '\0';
	if (ctl == CGROUP_DEVCTL_V1)
		return grant_v1(job_id, uid, task_pid, m.v1_devices, failure, failure_len);
	if (m.v2[0] && cgroup_pid_v2_path(task_pid, cgroup, sizeof(cgroup), &unified_only, &cause) == 0 && unified_only)
		return grant_v2(job_id, m.v2, cgroup, failure, failure_len);
	if (env_file_value(job_id, NULL, ANTMAN_ENV_GPU_DEVICES, value, sizeof(value)) <= 0)
		return 0;
	if (ctl == CGROUP_DEVCTL_UNIFIED) {
		/* A unified node where the task's cgroup cannot be read: whether it may open its GPU is unknown. */
		snprintf(failure, failure_len, "cannot allow its GPUs on this cgroup v2 node: %s",
			 cause ? cause : "the task is held by a cgroup v1 controller");
		return -1;
	}
	/* Hybrid or none: no v1 devices controller, and Slurm's cgroup/v2 runs only on a unified node. */
	slurm_debug("antman: job %u: device control here is %s; nothing of Slurm's denies its GPU(s) %s", job_id,
		    cgroup_devctl_name(ctl), value);
	return 0;
}

int antman_devices_refused(uint32_t job_id, uid_t uid, pid_t task_pid)
{
	struct cgroup_mounts m;
	enum cgroup_devctl ctl = cgroup_device_control("/proc/self/mounts", &m);
	char cgroup[PATH_MAX], job_dir[PATH_MAX], node[256], value[DEVICES_VALUE_MAX];
	const char *cause = NULL;
	bool unified_only = false;

	node[0] = '\0';
	if (ctl == CGROUP_DEVCTL_V1) {
		if (task_devices_cgroup(task_pid, cgroup, sizeof(cgroup)) < 0 ||
		    job_cgroup(cgroup, uid, job_id, job_dir, sizeof(job_dir), node, sizeof(node)) < 0)
			node[0] = '\0';
	} else if (m.v2[0] && cgroup_pid_v2_path(task_pid, cgroup, sizeof(cgroup), &unified_only, &cause) == 0 &&
		   unified_only) {
		if (!v2_job_cgroup(cgroup, job_id, node, sizeof(node)))
			node[0] = '\0';
	}
	return env_file_value(job_id, node[0] ? node : NULL, ANTMAN_ENV_REFUSED, value, sizeof(value)) > 0;
}
