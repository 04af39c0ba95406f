/*
 * Test driver for spank/devices.c's cgroup v2 path (tests/test_spank_cgroup_bpf.py links it with
 * devices.c and cgroup_bpf.c, and -Wl,--wrap for the two functions below):
 *
 *   devices_grant_driver JOBID CGROUP_DIR
 *
 * forks a child, moves it into the cgroup2 directory CGROUP_DIR, calls antman_devices_grant() for it
 * as task_post_fork would, and prints "rc=N node=NODE failure=TEXT" (NODE: what the env file was
 * looked up under, "-" for any node directory, "?" when it was not looked up). The env file is the
 * environment variable DEVICES (ANTMAN_GPU_DEVICES's value; unset: the job has none).
 *
 * The test host may be hybrid (cgroup v1 controllers beside cgroup2): the wrappers make it look
 * unified to devices.c, whose v2 path then runs against the kernel as on a unified node.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cgroup_bpf.h"
#include "devices.h"
#include "envfile.h"

static char looked_up_node[256] = "?";

void slurm_error(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("error: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

void slurm_info(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("info: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

void slurm_debug(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("debug: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

int env_file_value(uint32_t job_id, const char *node, const char *key, char *buf, size_t len)
{
	const char *value = getenv("DEVICES");

	(void)job_id;
	snprintf(looked_up_node, sizeof(looked_up_node), "%s", node ? node : "-");
	if (!value || strcmp(key, ANTMAN_ENV_GPU_DEVICES) != 0)
		return 0;
	snprintf(buf, len, "%s", value);
	return 1;
}

enum cgroup_devctl __real_cgroup_device_control(const char *mounts_path, struct cgroup_mounts *m);
int __real_cgroup_pid_v2_path(pid_t pid, char *buf, size_t len, bool *unified_only, const char **cause);

enum cgroup_devctl __wrap_cgroup_device_control(const char *mounts_path, struct cgroup_mounts *m)
{
	__real_cgroup_device_control(mounts_path, m);
	m->v1_devices[0] = '\0';
	m->v1_controllers = false;
	return m->v2[0] ? CGROUP_DEVCTL_UNIFIED : CGROUP_DEVCTL_NONE;
}

int __wrap_cgroup_pid_v2_path(pid_t pid, char *buf, size_t len, bool *unified_only, const char **cause)
{
	int rc = __real_cgroup_pid_v2_path(pid, buf, len, unified_only, cause);

	*unified_only = true;
	return rc;
}

int main(int argc, char **argv)
{
	char failure[1024], path[4096], pidbuf[32];
	int fd, len, rc, status;
	pid_t pid;

	if (argc != 3)
		return 2;
	pid = fork();
	if (pid < 0)
		return 1;
	if (pid == 0) {
		pause();
		_exit(0);
	}
	snprintf(path, sizeof(path), "%s/cgroup.procs", argv[2]);
	len = snprintf(pidbuf, sizeof(pidbuf), "%d", (int)pid);
	fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0 || write(fd, pidbuf, (size_t)len) != len) {
		perror(path);
		kill(pid, SIGKILL);
		waitpid(pid, &status, 0);
		return 1;
	}
	close(fd);
	rc = antman_devices_grant((uint32_t)strtoul(argv[1], NULL, 10), 0, pid, failure, sizeof(failure));
	printf("rc=%d node=%s failure=%s\n", rc, looked_up_node, failure);
	kill(pid, SIGKILL);
	waitpid(pid, &status, 0);
	return 0;
}
