/*
 * slurm-antman SPANK plugin.
 *
 * Allocator/local context (sbatch, salloc, srun): takes --antman=CLASS and puts
 * ANTMAN_CLASS into the job control environment, where job_submit.lua
 * (job_desc.spank_job_env), the Prolog/Epilog (SPANK_ANTMAN_CLASS) and the batch
 * script (SLURM_SPANK_ANTMAN_CLASS) find it.
 *
 * Remote context (slurmstepd): applies the node-local env file
 * STATE_DIR/NODE/jobs/JOBID.env, written by the Prolog, to every task, and
 * exports ANTMAN_JOB_ID. When a slurm-antman job's file is missing, it first runs
 * the Prolog hook itself, once per step: slurmd skips the Prolog when a job
 * preempted by requeue restarts on the same node while its credential is still
 * cached, but the Epilog of the first run did remove the file. The file is opened in task_init_privileged, while the
 * step still has root's rights (the Prolog may write it root-only), and read and
 * applied in task_init, which runs after Slurm has put its own GRES variables
 * (and SLURMD_NODENAME) into the task env, so CUDA_VISIBLE_DEVICES from the
 * file wins.
 */
#define _GNU_SOURCE /* asprintf, pipe2 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(antman, 1);

#define ANTMAN_DEFAULT_STATE_DIR "/var/lib/slurm-antman"
#define ANTMAN_ALLOWED_CLASSES "guaranteed, opportunistic, auto"
#define ANTMAN_ALLOWED_ARGS "state_dir=PATH, prolog=PATH, opp_partition=NAME"
/* slurmd gives a Prolog no PATH of the job's; this is what a root shell on the node has. */
#define PROLOG_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define PROLOG_TIMEOUT_S 30
#define PROLOG_ENV_MAX 16

/* A Prolog writes a handful of lines; anything far bigger is not ours. */
#define ENV_FILE_MAX_BYTES (64 * 1024)
#define ENV_FILE_MAX_ENTRIES 256
#define NODENAME_MAX 256
#define MAX_NODE_DIRS 64

static const char *const valid_classes[] = {"guaranteed", "opportunistic", "auto", NULL};

struct env_candidate {
	char node[NODENAME_MAX];
	int fd;        /* -1 when the open failed */
	int open_errno; /* why it failed, reported only if this is the task's node */
};

struct env_entry {
	char *key;
	char *value;
};

static struct {
	char state_dir[PATH_MAX];
	char prolog[PATH_MAX];        /* hook to run when the env file is missing, "" = never */
	char opp_partition[128];      /* a job in this partition is a slurm-antman job */
	char job_class[32]; /* validated --antman value, "" when not given */
	bool no_env_file;   /* an opportunistic job whose env file no Prolog could write here */
	uid_t stepd_euid;   /* euid of slurmstepd, recorded before it drops to the user */
	struct env_candidate candidates[MAX_NODE_DIRS]; /* opened while privileged */
	size_t n_candidates;
	struct env_entry entries[ENV_FILE_MAX_ENTRIES];
	size_t n_entries;
} antman = {
	.state_dir = ANTMAN_DEFAULT_STATE_DIR,
};

static int antman_opt_class(int val, const char *optarg, int remote);

static struct spank_option antman_options[] = {
	{
		"antman",
		"CLASS",
		"slurm-antman job class: guaranteed, opportunistic or auto",
		1,
		0,
		antman_opt_class,
	},
	SPANK_OPTIONS_TABLE_END,
};

/* Bad values end up in a terminal and in logs: keep control bytes out of both. */
static void printable_copy(char *dst, size_t dst_len, const char *src)
{
	size_t i = 0;

	for (; *src && i + 4 < dst_len; src++) {
		unsigned char c = (unsigned char)*src;
		if (isprint(c)) {
			dst[i++] = (char)c;
		} else {
			snprintf(dst + i, dst_len - i, "\\x%02x", c);
			i += 4;
		}
	}
	if (*src && i + 3 < dst_len) {
		memcpy(dst + i, "...", 3);
		i += 3;
	}
	dst[i] = '\0';
}

static bool class_is_valid(const char *value)
{
	for (size_t i = 0; valid_classes[i]; i++) {
		if (strcmp(value, valid_classes[i]) == 0)
			return true;
	}
	return false;
}

static int antman_opt_class(int val, const char *optarg, int remote)
{
	char shown[96];

	(void)val;
	(void)remote;
	if (!optarg || !class_is_valid(optarg)) {
		printable_copy(shown, sizeof(shown), optarg ? optarg : "");
		slurm_error("--antman: invalid value '%s'; allowed values: %s",
			    shown, ANTMAN_ALLOWED_CLASSES);
		return ESPANK_BAD_ARG;
	}
	snprintf(antman.job_class, sizeof(antman.job_class), "%s", optarg);
	return ESPANK_SUCCESS;
}

/* Copies an absolute-path argument; "what" names it in the error. */
static int path_arg(char *dst, size_t len, const char *what, const char *path)
{
	if (path[0] != '/') {
		slurm_error("antman: plugstack.conf argument %s must be an absolute path, got '%s'", what, path);
		return -1;
	}
	if (strlen(path) >= len) {
		slurm_error("antman: plugstack.conf argument %s is too long (%zu bytes)", what, strlen(path));
		return -1;
	}
	snprintf(dst, len, "%s", path);
	return 0;
}

static int parse_plugin_args(int ac, char **av)
{
	for (int i = 0; i < ac; i++) {
		if (strncmp(av[i], "state_dir=", 10) == 0) {
			if (path_arg(antman.state_dir, sizeof(antman.state_dir), "state_dir", av[i] + 10) < 0)
				return -1;
		} else if (strncmp(av[i], "prolog=", 7) == 0) {
			if (path_arg(antman.prolog, sizeof(antman.prolog), "prolog", av[i] + 7) < 0)
				return -1;
		} else if (strncmp(av[i], "opp_partition=", 14) == 0) {
			const char *name = av[i] + 14;
			if (name[0] == '\0' || strlen(name) >= sizeof(antman.opp_partition)) {
				slurm_error("antman: plugstack.conf argument opp_partition must be a partition name of 1 to %zu bytes, got '%s'",
					    sizeof(antman.opp_partition) - 1, name);
				return -1;
			}
			snprintf(antman.opp_partition, sizeof(antman.opp_partition), "%s", name);
		} else {
			slurm_error("antman: unknown plugstack.conf argument '%s'; allowed: %s",
				    av[i], ANTMAN_ALLOWED_ARGS);
			return -1;
		}
	}
	return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();

	if (parse_plugin_args(ac, av) < 0)
		return -1;

	if (ctx == S_CTX_REMOTE)
		antman.stepd_euid = geteuid();

	/* Only these contexts parse user options; registering elsewhere is refused. */
	if (ctx != S_CTX_ALLOCATOR && ctx != S_CTX_LOCAL && ctx != S_CTX_REMOTE)
		return 0;

	for (struct spank_option *opt = antman_options; opt->name; opt++) {
		spank_err_t rc = spank_option_register(sp, opt);
		if (rc != ESPANK_SUCCESS) {
			slurm_error("antman: cannot register option --%s: %s",
				    opt->name, spank_strerror(rc));
			return -1;
		}
	}
	return 0;
}

static int init_post_opt_submit(spank_t sp)
{
	spank_err_t rc;

	if (antman.job_class[0] == '\0')
		return 0;
	rc = spank_job_control_setenv(sp, "ANTMAN_CLASS", antman.job_class, 1);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("antman: cannot pass --antman=%s to the job: %s",
			    antman.job_class, spank_strerror(rc));
		return -1;
	}
	return 0;
}

static bool key_is_valid(const char *key, size_t len)
{
	if (len == 0 || !(key[0] == '_' || (key[0] >= 'A' && key[0] <= 'Z')))
		return false;
	for (size_t i = 1; i < len; i++) {
		char c = key[i];
		if (!(c == '_' || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')))
			return false;
	}
	return true;
}

/* The name becomes a path component: refuse anything that could walk out of STATE_DIR. */
static bool nodename_is_safe(const char *name)
{
	if (name[0] == '\0' || name[0] == '.')
		return false;
	for (const char *p = name; *p; p++) {
		unsigned char c = (unsigned char)*p;
		if (!(isalnum(c) || c == '-' || c == '_' || c == '.'))
			return false;
	}
	return true;
}

static int node_name(spank_t sp, char *buf, size_t len)
{
	if (spank_getenv(sp, "SLURMD_NODENAME", buf, (int)len) == ESPANK_SUCCESS && buf[0])
		return 0;
	if (gethostname(buf, len) == 0) {
		buf[len - 1] = '\0';
		/* Slurm node names are short names. */
		char *dot = strchr(buf, '.');
		if (dot)
			*dot = '\0';
		return 0;
	}
	slurm_error("antman: cannot tell the node name: no SLURMD_NODENAME and gethostname failed: %m");
	return -1;
}

static void free_entries(void)
{
	for (size_t i = 0; i < antman.n_entries; i++) {
		free(antman.entries[i].key);
		free(antman.entries[i].value);
	}
	antman.n_entries = 0;
}

static bool file_is_trusted(const char *path, const struct stat *st)
{
	if (!S_ISREG(st->st_mode)) {
		slurm_error("antman: %s is not a regular file; not applied", path);
		return false;
	}
	if (st->st_uid != 0 && st->st_uid != antman.stepd_euid) {
		slurm_error("antman: %s is owned by uid %u, not root or the slurmd user (uid %u); not applied",
			    path, (unsigned)st->st_uid, (unsigned)antman.stepd_euid);
		return false;
	}
	if (st->st_mode & (S_IWGRP | S_IWOTH)) {
		slurm_error("antman: %s is group or world writable (mode %04o); not applied",
			    path, (unsigned)(st->st_mode & 07777));
		return false;
	}
	if (st->st_size > ENV_FILE_MAX_BYTES) {
		slurm_error("antman: %s is %lld bytes, more than the %d allowed; not applied",
			    path, (long long)st->st_size, ENV_FILE_MAX_BYTES);
		return false;
	}
	return true;
}

static int add_entry(const char *key, size_t key_len, const char *value)
{
	struct env_entry *e;

	if (antman.n_entries == ENV_FILE_MAX_ENTRIES)
		return -1;
	e = &antman.entries[antman.n_entries];
	e->key = strndup(key, key_len);
	e->value = strdup(value);
	if (!e->key || !e->value) {
		free(e->key);
		free(e->value);
		return -1;
	}
	antman.n_entries++;
	return 0;
}

static bool line_is_blank(const char *line)
{
	for (; *line; line++) {
		if (!isspace((unsigned char)*line))
			return false;
	}
	return true;
}

static void parse_env_stream(FILE *f, const char *path)
{
	char *line = NULL;
	size_t cap = 0;
	ssize_t n;
	unsigned lineno = 0;

	while ((n = getline(&line, &cap, f)) >= 0) {
		lineno++;
		if (n > 0 && line[n - 1] == '\n')
			line[--n] = '\0';
		if ((size_t)n != strlen(line)) {
			slurm_error("antman: %s:%u: NUL byte in line; skipped", path, lineno);
			continue;
		}
		if (line[0] == '#' || line_is_blank(line))
			continue;
		char *eq = strchr(line, '=');
		if (!eq || !key_is_valid(line, (size_t)(eq - line))) {
			slurm_error("antman: %s:%u: not KEY=VALUE with KEY matching [A-Z_][A-Z0-9_]*; skipped",
				    path, lineno);
			continue;
		}
		if (add_entry(line, (size_t)(eq - line), eq + 1) < 0) {
			slurm_error("antman: %s:%u: more than %d entries or out of memory; rest of file skipped",
				    path, lineno, ENV_FILE_MAX_ENTRIES);
			break;
		}
	}
	free(line);
}

static int env_file_path(char *buf, size_t len, const char *node, uint32_t job_id)
{
	if (snprintf(buf, len, "%s/%s/jobs/%u.env", antman.state_dir, node, job_id) >= (int)len) {
		slurm_error("antman: env file path for job %u on node %s is too long", job_id, node);
		return -1;
	}
	return 0;
}

static int open_env_file(const char *path)
{
	return open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
}

/*
 * The task's node name (SLURMD_NODENAME) only enters the job env after task_init_privileged,
 * and once the step runs as the user a root-only file can no longer be opened. So while still
 * privileged, open JOBID.env under every node directory of STATE_DIR (one on a real node,
 * several where many slurmd share a host), and let task_init pick the one for its node.
 */
static void preopen_env_files(uint32_t job_id)
{
	char path[PATH_MAX];
	struct dirent *de;
	DIR *dir;

	dir = opendir(antman.state_dir);
	if (!dir) {
		if (errno == ENOENT)
			slurm_debug("antman: state_dir %s does not exist; no env files", antman.state_dir);
		else
			slurm_error("antman: cannot list state_dir %s: %m", antman.state_dir);
		return;
	}
	while ((de = readdir(dir)) && antman.n_candidates < MAX_NODE_DIRS) {
		struct env_candidate *c = &antman.candidates[antman.n_candidates];
		int fd;

		if (!nodename_is_safe(de->d_name) || strlen(de->d_name) >= sizeof(c->node))
			continue;
		if (env_file_path(path, sizeof(path), de->d_name, job_id) < 0)
			continue;
		fd = open_env_file(path);
		if (fd < 0 && (errno == ENOENT || errno == ENOTDIR))
			continue;
		snprintf(c->node, sizeof(c->node), "%s", de->d_name);
		c->fd = fd;
		c->open_errno = fd < 0 ? errno : 0;
		antman.n_candidates++;
	}
	closedir(dir);
}

static void close_candidates(void)
{
	for (size_t i = 0; i < antman.n_candidates; i++) {
		if (antman.candidates[i].fd >= 0)
			close(antman.candidates[i].fd);
	}
	antman.n_candidates = 0;
}

/* Takes ownership of fd. A bad file is logged and ignored: it never fails the step. */
static void read_env_fd(int fd, const char *path)
{
	struct stat st;
	FILE *f;

	if (fstat(fd, &st) < 0) {
		slurm_error("antman: cannot stat %s: %m; not applied", path);
		close(fd);
		return;
	}
	if (!file_is_trusted(path, &st)) {
		close(fd);
		return;
	}
	f = fdopen(fd, "r");
	if (!f) {
		slurm_error("antman: cannot read %s: %m; not applied", path);
		close(fd);
		return;
	}
	parse_env_stream(f, path);
	fclose(f);
	slurm_debug("antman: read %zu variables from %s", antman.n_entries, path);
}

static void load_env_file(spank_t sp, uint32_t job_id)
{
	char node[NODENAME_MAX];
	char path[PATH_MAX];
	int fd = -1;
	int open_errno = 0;

	if (node_name(sp, node, sizeof(node)) < 0)
		return;
	if (!nodename_is_safe(node)) {
		slurm_error("antman: node name '%s' is not usable as a path component; env file not read", node);
		return;
	}
	if (env_file_path(path, sizeof(path), node, job_id) < 0)
		return;
	for (size_t i = 0; i < antman.n_candidates; i++) {
		if (strcmp(antman.candidates[i].node, node) == 0) {
			fd = antman.candidates[i].fd;
			open_errno = antman.candidates[i].open_errno;
			antman.candidates[i].fd = -1;
			break;
		}
	}
	close_candidates();
	if (open_errno) {
		/* Root could not open it either; a retry as the user would only hide why. */
		errno = open_errno;
		slurm_error("antman: cannot open %s: %m; not applied", path);
		return;
	}
	if (fd < 0) {
		/* Not pre-opened (no privileged phase, or written since): try with the user's rights. */
		fd = open_env_file(path);
		if (fd < 0) {
			if (errno == ENOENT)
				slurm_debug("antman: no env file %s; nothing to apply", path);
			else
				slurm_error("antman: cannot open %s: %m; not applied", path);
			return;
		}
	}
	read_env_fd(fd, path);
}

static int job_id_of(spank_t sp, uint32_t *job_id)
{
	spank_err_t rc = spank_get_item(sp, S_JOB_ID, job_id);

	if (rc != ESPANK_SUCCESS) {
		slurm_error("antman: cannot get the job id: %s", spank_strerror(rc));
		return -1;
	}
	return 0;
}

/* The job env value of name, or "" when the step has none. */
static void job_getenv(spank_t sp, const char *name, char *buf, size_t len)
{
	if (spank_getenv(sp, name, buf, (int)len) != ESPANK_SUCCESS)
		buf[0] = '\0';
}

/*
 * Whether the Prolog already wrote this job's env file here. Without SLURMD_NODENAME (absent
 * before tasks exist) any node directory counts: a real node has only its own, and only a
 * development host running several slurmd can hold another node's file for the same job.
 */
static bool env_file_in_any_node_dir(uint32_t job_id);

static bool env_file_present(spank_t sp, uint32_t job_id)
{
	char node[NODENAME_MAX];
	char path[PATH_MAX];
	struct stat st;

	job_getenv(sp, "SLURMD_NODENAME", node, sizeof(node));
	if (node[0] && nodename_is_safe(node)) {
		if (env_file_path(path, sizeof(path), node, job_id) < 0)
			return true; /* cannot name it, so cannot write it either: do not run the hook */
		return lstat(path, &st) == 0;
	}
	return env_file_in_any_node_dir(job_id);
}

/* Any node directory: what the Prolog wrote, wherever the step's (user-set) environment says it runs. */
static bool env_file_in_any_node_dir(uint32_t job_id)
{
	char path[PATH_MAX];
	struct stat st;
	struct dirent *de;
	DIR *dir;
	bool found = false;

	dir = opendir(antman.state_dir);
	if (!dir)
		return false;
	while (!found && (de = readdir(dir))) {
		if (!nodename_is_safe(de->d_name))
			continue;
		if (env_file_path(path, sizeof(path), de->d_name, job_id) == 0 && lstat(path, &st) == 0)
			found = true;
	}
	closedir(dir);
	return found;
}

/* The class the user asked for: the remote --antman callback, else the job control env. */
static void requested_class(spank_t sp, char *buf, size_t len)
{
	if (antman.job_class[0]) {
		snprintf(buf, len, "%s", antman.job_class);
		return;
	}
	job_getenv(sp, "SLURM_SPANK_ANTMAN_CLASS", buf, len);
	if (buf[0] && !class_is_valid(buf))
		buf[0] = '\0';
}

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

/* A Prolog environment from what slurmstepd knows, never from the job's own environment. */
static void build_prolog_env(spank_t sp, uint32_t job_id, const char *job_class, struct prolog_env *e)
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
		prolog_env_add(e, "ANTMAN_JOB_NODEID", buf);
	}
	prolog_env_add(e, "SPANK_ANTMAN_CLASS", job_class);
	/* The node's own slurm.conf, where slurmd was not started with the default one. */
	prolog_env_add(e, "SLURM_CONF", getenv("SLURM_CONF"));
	prolog_env_add(e, "PATH", PROLOG_PATH);
	prolog_env_add(e, "ANTMAN_PROLOG_FROM_SPANK", "1");
}

/* Only async-signal-safe calls: slurmstepd has threads, and this is the child of its fork. */
static void exec_prolog_child(char **envp, int report_fd)
{
	sigset_t none;
	char *argv[] = {antman.prolog, NULL};
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
	execve(antman.prolog, argv, envp);
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

/* Runs the hook and waits for it, at most PROLOG_TIMEOUT_S. Every failure is logged only. */
static void run_prolog(uint32_t job_id, char **envp)
{
	int report[2];
	int exec_errno = 0;
	int status = 0;
	ssize_t got;
	pid_t pid, r;
	double deadline;

	if (pipe2(report, O_CLOEXEC) < 0) {
		slurm_error("antman: job %u: cannot run prolog %s: pipe: %m", job_id, antman.prolog);
		return;
	}
	pid = fork();
	if (pid < 0) {
		slurm_error("antman: job %u: cannot run prolog %s: fork: %m", job_id, antman.prolog);
		close(report[0]);
		close(report[1]);
		return;
	}
	if (pid == 0)
		exec_prolog_child(envp, report[1]);
	setpgid(pid, pid); /* also done by the child; whichever runs first makes the kill below reach both */
	close(report[1]);
	/* EOF as soon as execve succeeded (close-on-exec), an errno if it failed. */
	do {
		got = read(report[0], &exec_errno, sizeof(exec_errno));
	} while (got < 0 && errno == EINTR);
	close(report[0]);
	if (got == (ssize_t)sizeof(exec_errno)) {
		errno = exec_errno;
		slurm_error("antman: job %u: cannot execute prolog %s: %m; tasks start without the env file",
			    job_id, antman.prolog);
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
			slurm_error("antman: job %u: lost prolog %s (pid %d): %m", job_id, antman.prolog, (int)pid);
			return;
		}
		if (monotonic_s() > deadline) {
			kill(-pid, SIGKILL);
			kill(pid, SIGKILL);
			while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
				;
			slurm_error("antman: job %u: prolog %s ran longer than %d s and was killed",
				    job_id, antman.prolog, PROLOG_TIMEOUT_S);
			return;
		}
		poll(NULL, 0, 20);
	}
	if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
		slurm_info("antman: job %u: env file was missing; ran prolog %s", job_id, antman.prolog);
	else if (WIFEXITED(status))
		slurm_error("antman: job %u: prolog %s exited with status %d", job_id, antman.prolog,
			    WEXITSTATUS(status));
	else
		slurm_error("antman: job %u: prolog %s killed by signal %d", job_id, antman.prolog,
			    WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

/*
 * Once per step, as root, before any task exists: if this slurm-antman job has no env file here,
 * slurmd skipped the Prolog (a requeued job restarting on a node that still caches its
 * credential), so run it now; task_init_privileged then finds the file it wrote.
 */
static void init_post_opt_remote(spank_t sp)
{
	uint32_t job_id;
	char job_class[32];
	char partition[128];
	struct prolog_env env;

	if (antman.prolog[0] == '\0' || job_id_of(sp, &job_id) < 0)
		return;
	requested_class(sp, job_class, sizeof(job_class));
	job_getenv(sp, "SLURM_JOB_PARTITION", partition, sizeof(partition));
	if (job_class[0] == '\0' && !(antman.opp_partition[0] && strcmp(partition, antman.opp_partition) == 0))
		return;
	if (env_file_present(sp, job_id))
		return;
	build_prolog_env(sp, job_id, job_class, &env);
	run_prolog(job_id, env.vars);
	prolog_env_free(&env);
	/*
	 * Still no file (the state directory full or unwritable, the hook broken): the Prolog could not
	 * even record a refusal. An opportunistic job must not run unmanaged beside a guaranteed one, so
	 * its tasks fail; the Prolog has asked Slurm to requeue it. A guaranteed job runs on the GPUs
	 * Slurm bound, as it would without slurm-antman.
	 */
	if (!env_file_in_any_node_dir(job_id) &&
	    (strcmp(job_class, "opportunistic") == 0 ||
	     (antman.opp_partition[0] && strcmp(partition, antman.opp_partition) == 0)))
		antman.no_env_file = true;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	switch (spank_context()) {
	case S_CTX_ALLOCATOR:
	case S_CTX_LOCAL:
		return init_post_opt_submit(sp);
	case S_CTX_REMOTE:
		init_post_opt_remote(sp);
		return 0;
	default:
		return 0;
	}
}

int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
	uint32_t job_id;

	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	if (job_id_of(sp, &job_id) == 0)
		preopen_env_files(job_id);
	return 0;
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	uint32_t job_id;
	char buf[16];

	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	if (job_id_of(sp, &job_id) < 0)
		return 0;

	if (antman.no_env_file) {
		slurm_error("antman: job %u not started on this node: it is opportunistic and the node could not "
			    "write its env file (state directory %s full or unwritable?)", job_id, antman.state_dir);
		return -1;
	}
	load_env_file(sp, job_id);
	/*
	 * The Prolog found no GPU this opportunistic job may use under the rules (or no sidecar to ask)
	 * and asked Slurm to requeue it: the task must not start unmanaged in the meantime (fail closed).
	 */
	for (size_t i = 0; i < antman.n_entries; i++) {
		if (strcmp(antman.entries[i].key, "ANTMAN_REFUSED") == 0) {
			slurm_error("antman: job %u not started on this node: %s", job_id, antman.entries[i].value);
			return -1;
		}
	}
	snprintf(buf, sizeof(buf), "%u", job_id);
	if (spank_setenv(sp, "ANTMAN_JOB_ID", buf, 1) != ESPANK_SUCCESS)
		slurm_error("antman: cannot set ANTMAN_JOB_ID in the task env");
	for (size_t i = 0; i < antman.n_entries; i++) {
		spank_err_t rc = spank_setenv(sp, antman.entries[i].key, antman.entries[i].value, 1);
		if (rc != ESPANK_SUCCESS)
			slurm_error("antman: cannot set %s in the task env: %s",
				    antman.entries[i].key, spank_strerror(rc));
	}
	return 0;
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	close_candidates();
	free_entries();
	return 0;
}
