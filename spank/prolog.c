/*
 * Runs the Prolog hook from slurmstepd (remote context), as root, once per step: slurmd skips the
 * Prolog when a job preempted by requeue restarts on the same node while its credential is still
 * cached, but the Epilog of the first run did remove the env file. Also when a placed GPU could not
 * be allowed in the task's device cgroup: with ANTMAN_DEVICE_FAILURE set, the hook refuses the job
 * and has Slurm requeue it.
 */
#define _GNU_SOURCE /* asprintf, pipe2 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "prolog.h"

/* slurmd gives a Prolog no PATH of the job's; this is what a root shell on the node has. */
#define PROLOG_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define PROLOG_TIMEOUT_S 30
#define PROLOG_ENV_MAX 16
#define DEVICE_FAILURE_MAX 512

struct prolog_env {
	char *vars[PROLOG_ENV_MAX + 1];
	size_t n;
};

static void prolog_env_add(struct prolog_env *e, const char *key, const char *value)
{
	char *var;

	if (!value || !value[0] || e->n == PROLOG_ENV_MAX)
		return;
	if (asprintf(&var, "%s=%s", key, value) < 0)
		return;
	e->vars[e->n++] = var;
	e->vars[e->n] = NULL;
}

static void prolog_env_free(struct prolog_env *e)
{
	for (size_t i = 0; i < e->n; i++)
		free(e->vars[i]);
	e->n = 0;
}

/*
 * ANTMAN_DEVICE_FAILURE's value: the plugin's own text (devices.c), kept to [A-Za-z0-9 _:.,()/-]
 * all the same, any other byte becoming '_', so the hook can log and pass it on without quoting.
 */
static void device_failure_value(const char *failure, char *buf, size_t len)
{
	size_t i;

	for (i = 0; failure[i] && i + 1 < len; i++) {
		unsigned char c = (unsigned char)failure[i];

		buf[i] = (isalnum(c) && c < 0x80) || strchr(" _:.,()/-", c) ? (char)c : '_';
	}
	buf[i] = '\0';
}

/* A Prolog environment from what slurmstepd knows, never from the job's own environment. */
static void build_prolog_env(spank_t sp, uint32_t job_id, const char *job_class, const char *device_failure,
			     struct prolog_env *e)
{
	char buf[1024];
	uid_t uid = 0;
	gid_t gid = 0;
	struct passwd pw, *found = NULL;
	char pwbuf[4096];

	e->n = 0;
	e->vars[0] = NULL;
	snprintf(buf, sizeof(buf), "%u", job_id);
	prolog_env_add(e, "SLURM_JOB_ID", buf);
	if (spank_get_item(sp, S_JOB_UID, &uid) == ESPANK_SUCCESS) {
		snprintf(buf, sizeof(buf), "%u", (unsigned)uid);
		prolog_env_add(e, "SLURM_JOB_UID", buf);
		if (getpwuid_r(uid, &pw, pwbuf, sizeof(pwbuf), &found) == 0 && found)
			prolog_env_add(e, "SLURM_JOB_USER", pw.pw_name);
	}
	if (spank_get_item(sp, S_JOB_GID, &gid) == ESPANK_SUCCESS) {
		snprintf(buf, sizeof(buf), "%u", (unsigned)gid);
		prolog_env_add(e, "SLURM_JOB_GID", buf);
	}
	/*
	 * Nothing from the step's environment, which the user controls (a forged SLURMD_NODENAME or
	 * SLURM_JOB_GPUS would have root register the job elsewhere): only what slurmstepd says, and the
	 * hook asks slurmctld for the node list, partition and GPUs.
	 */
	uint32_t nodeid = 0;
	if (spank_get_item(sp, S_JOB_NODEID, &nodeid) == ESPANK_SUCCESS) {
		snprintf(buf, sizeof(buf), "%u", nodeid);
		prolog_env_add(e, ANTMAN_ENV_JOB_NODEID, buf);
	}
	/*
	 * An array task's own id for a refusal made before the hook has read the job's record: the raw
	 * id of the task that carries its array's id names every task to scontrol requeue.
	 */
	uint32_t array_id = 0, array_task = 0;
	if (spank_get_item(sp, S_JOB_ARRAY_ID, &array_id) == ESPANK_SUCCESS && array_id &&
	    spank_get_item(sp, S_JOB_ARRAY_TASK_ID, &array_task) == ESPANK_SUCCESS) {
		snprintf(buf, sizeof(buf), "%u", array_id);
		prolog_env_add(e, "SLURM_ARRAY_JOB_ID", buf);
		snprintf(buf, sizeof(buf), "%u", array_task);
		prolog_env_add(e, "SLURM_ARRAY_TASK_ID", buf);
	}
	prolog_env_add(e, ANTMAN_ENV_SPANK_CLASS, job_class);
	/* The node's own slurm.conf, where slurmd was not started with the default one. */
	prolog_env_add(e, "SLURM_CONF", getenv("SLURM_CONF"));
	prolog_env_add(e, "PATH", PROLOG_PATH);
	prolog_env_add(e, ANTMAN_ENV_PROLOG_FROM_SPANK, "1");
	if (device_failure) {
		char value[DEVICE_FAILURE_MAX];

		device_failure_value(device_failure, value, sizeof(value));
		prolog_env_add(e, ANTMAN_ENV_DEVICE_FAILURE, value);
	}
}

/* Only async-signal-safe calls: slurmstepd has threads, and this is the child of its fork. */
static void exec_prolog_child(const char *prolog, char **envp, int report_fd)
{
	sigset_t none;
	/* execve takes char *const argv[] for historical reasons; it does not write to the strings. */
	char *argv[] = {(char *)prolog, NULL};
	int err, devnull;

	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	for (int sig = 1; sig < NSIG; sig++)
		signal(sig, SIG_DFL);
	setpgid(0, 0);
	devnull = open("/dev/null", O_RDWR);
	if (devnull >= 0) {
		dup2(devnull, 0);
		dup2(devnull, 1);
		dup2(devnull, 2);
	}
	/* slurmstepd's sockets and files are none of the hook's business. */
	for (int fd = 3; fd < 1024; fd++) {
		if (fd != report_fd)
			close(fd);
	}
	execve(prolog, argv, envp);
	err = errno;
	if (write(report_fd, &err, sizeof(err)) < 0)
		_exit(127);
	_exit(127);
}

static double monotonic_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/*
 * Runs the hook and waits for it, at most PROLOG_TIMEOUT_S. Every failure is logged only; requeue
 * says why it runs (a device failure: the hook is to requeue the job) for the log lines.
 */
static void run_prolog(const char *prolog, uint32_t job_id, char **envp, bool requeue)
{
	int report[2];
	int exec_errno = 0;
	int status = 0;
	ssize_t got;
	pid_t pid, r;
	double deadline;

	if (pipe2(report, O_CLOEXEC) < 0) {
		slurm_error("antman: job %u: cannot run prolog %s: pipe: %m", job_id, prolog);
		return;
	}
	pid = fork();
	if (pid < 0) {
		slurm_error("antman: job %u: cannot run prolog %s: fork: %m", job_id, prolog);
		close(report[0]);
		close(report[1]);
		return;
	}
	if (pid == 0)
		exec_prolog_child(prolog, envp, report[1]);
	setpgid(pid, pid); /* also done by the child; whichever runs first makes the kill below reach both */
	close(report[1]);
	/* EOF as soon as execve succeeded (close-on-exec), an errno if it failed. */
	do {
		got = read(report[0], &exec_errno, sizeof(exec_errno));
	} while (got < 0 && errno == EINTR);
	close(report[0]);
	if (got == (ssize_t)sizeof(exec_errno)) {
		errno = exec_errno;
		slurm_error("antman: job %u: cannot execute prolog %s: %m; %s", job_id, prolog,
			    requeue ? "the job is not requeued" : "tasks start without the env file");
		while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
			;
		return;
	}
	deadline = monotonic_s() + PROLOG_TIMEOUT_S;
	for (;;) {
		r = waitpid(pid, &status, WNOHANG);
		if (r == pid)
			break;
		if (r < 0 && errno != EINTR) {
			slurm_error("antman: job %u: lost prolog %s (pid %d): %m", job_id, prolog, (int)pid);
			return;
		}
		if (monotonic_s() > deadline) {
			kill(-pid, SIGKILL);
			kill(pid, SIGKILL);
			while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
				;
			slurm_error("antman: job %u: prolog %s ran longer than %d s and was killed",
				    job_id, prolog, PROLOG_TIMEOUT_S);
			return;
		}
		poll(NULL, 0, 20);
	}
	if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && requeue)
		slurm_info("antman: job %u: ran prolog %s with %s to requeue it", job_id, prolog,
			   ANTMAN_ENV_DEVICE_FAILURE);
	else if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
		slurm_info("antman: job %u: env file was missing; ran prolog %s", job_id, prolog);
	else if (WIFEXITED(status))
		slurm_error("antman: job %u: prolog %s exited with status %d", job_id, prolog,
			    WEXITSTATUS(status));
	else
		slurm_error("antman: job %u: prolog %s killed by signal %d", job_id, prolog,
			    WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

void run_prolog_hook(spank_t sp, const char *prolog, uint32_t job_id, const char *job_class,
		     const char *device_failure)
{
	struct prolog_env env;

	build_prolog_env(sp, job_id, job_class, device_failure, &env);
	run_prolog(prolog, job_id, env.vars, device_failure != NULL);
	prolog_env_free(&env);
}
