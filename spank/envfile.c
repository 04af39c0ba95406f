/*
 * The job's env file, STATE_DIR/NODE/jobs/JOBID.env (remote context, slurmstepd).
 *
 * The file is opened in task_init_privileged, while the step still has root's rights (the Prolog
 * may write it root-only), and read and applied in task_init, which runs after Slurm has put its
 * own GRES variables (and SLURMD_NODENAME) into the task env, so CUDA_VISIBLE_DEVICES from the
 * file wins.
 */
#define _GNU_SOURCE /* getline, strndup: the glibc feature set the plugin has always been built with */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "args.h"
#include "envfile.h"

/* A Prolog writes a handful of lines; anything far bigger is not ours. */
#define ENV_FILE_MAX_BYTES (64 * 1024)
#define ENV_FILE_MAX_ENTRIES 256
#define NODENAME_MAX 256
#define MAX_NODE_DIRS 64

struct env_candidate {
	char node[NODENAME_MAX];
	int fd;        /* -1 when the open failed */
	int open_errno; /* why it failed, reported only if this is the task's node */
};

static struct {
	uid_t stepd_euid;   /* euid of slurmstepd, recorded before it drops to the user */
	struct env_candidate candidates[MAX_NODE_DIRS]; /* opened while privileged */
	size_t n_candidates;
	struct env_entry entries[ENV_FILE_MAX_ENTRIES];
	size_t n_entries;
} envfile;

void env_file_trust_owner(uid_t stepd_euid)
{
	envfile.stepd_euid = stepd_euid;
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
	for (size_t i = 0; i < envfile.n_entries; i++) {
		free(envfile.entries[i].key);
		free(envfile.entries[i].value);
	}
	envfile.n_entries = 0;
}

static bool file_is_trusted(const char *path, const struct stat *st)
{
	if (!S_ISREG(st->st_mode)) {
		slurm_error("antman: %s is not a regular file; not applied", path);
		return false;
	}
	if (st->st_uid != 0 && st->st_uid != envfile.stepd_euid) {
		slurm_error("antman: %s is owned by uid %u, not root or the slurmd user (uid %u); not applied",
			    path, (unsigned)st->st_uid, (unsigned)envfile.stepd_euid);
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

	if (envfile.n_entries == ENV_FILE_MAX_ENTRIES)
		return -1;
	e = &envfile.entries[envfile.n_entries];
	e->key = strndup(key, key_len);
	e->value = strdup(value);
	if (!e->key || !e->value) {
		free(e->key);
		free(e->value);
		return -1;
	}
	envfile.n_entries++;
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

enum env_line {
	ENV_LINE_ENTRY,   /* KEY=VALUE */
	ENV_LINE_NOTHING, /* a comment or a blank line */
	ENV_LINE_NUL,     /* a NUL byte: the C string would end early, so the line is skipped */
	ENV_LINE_BAD,     /* no '=' or a key outside [A-Z_][A-Z0-9_]* */
};

/*
 * One line as getline returned it (n bytes), newline removed in place. The task env and
 * env_file_value both classify lines here, so a root-side lookup never sees an entry the task
 * env does not get (docs/protocol.md, "The job env file").
 */
static enum env_line classify_line(char *line, ssize_t n, size_t *key_len)
{
	if (n > 0 && line[n - 1] == '\n')
		line[--n] = '\0';
	if ((size_t)n != strlen(line))
		return ENV_LINE_NUL;
	if (line[0] == '#' || line_is_blank(line))
		return ENV_LINE_NOTHING;
	char *eq = strchr(line, '=');
	if (!eq || !key_is_valid(line, (size_t)(eq - line)))
		return ENV_LINE_BAD;
	*key_len = (size_t)(eq - line);
	return ENV_LINE_ENTRY;
}

static void parse_env_stream(FILE *f, const char *path)
{
	char *line = NULL;
	size_t cap = 0, key_len = 0;
	ssize_t n;
	unsigned lineno = 0;

	while ((n = getline(&line, &cap, f)) >= 0) {
		lineno++;
		switch (classify_line(line, n, &key_len)) {
		case ENV_LINE_NOTHING:
			continue;
		case ENV_LINE_NUL:
			slurm_error("antman: %s:%u: NUL byte in line; skipped", path, lineno);
			continue;
		case ENV_LINE_BAD:
			slurm_error("antman: %s:%u: not KEY=VALUE with KEY matching [A-Z_][A-Z0-9_]*; skipped",
				    path, lineno);
			continue;
		case ENV_LINE_ENTRY:
			break;
		}
		if (add_entry(line, key_len, line + key_len + 1) < 0) {
			slurm_error("antman: %s:%u: more than %d entries or out of memory; rest of file skipped",
				    path, lineno, ENV_FILE_MAX_ENTRIES);
			break;
		}
	}
	free(line);
}

static int env_file_path(char *buf, size_t len, const char *node, uint32_t job_id)
{
	if (snprintf(buf, len, "%s/%s/jobs/%u.env", antman_args_get()->state_dir, node, job_id) >= (int)len) {
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
void preopen_env_files(uint32_t job_id)
{
	const char *state_dir = antman_args_get()->state_dir;
	char path[PATH_MAX];
	struct dirent *de;
	DIR *dir;

	dir = opendir(state_dir);
	if (!dir) {
		if (errno == ENOENT)
			slurm_debug("antman: state_dir %s does not exist; no env files", state_dir);
		else
			slurm_error("antman: cannot list state_dir %s: %m", state_dir);
		return;
	}
	while ((de = readdir(dir)) && envfile.n_candidates < MAX_NODE_DIRS) {
		struct env_candidate *c = &envfile.candidates[envfile.n_candidates];
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
		envfile.n_candidates++;
	}
	closedir(dir);
}

static void close_candidates(void)
{
	for (size_t i = 0; i < envfile.n_candidates; i++) {
		if (envfile.candidates[i].fd >= 0)
			close(envfile.candidates[i].fd);
	}
	envfile.n_candidates = 0;
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
	slurm_debug("antman: read %zu variables from %s", envfile.n_entries, path);
}

void load_env_file(spank_t sp, uint32_t job_id)
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
	for (size_t i = 0; i < envfile.n_candidates; i++) {
		if (strcmp(envfile.candidates[i].node, node) == 0) {
			fd = envfile.candidates[i].fd;
			open_errno = envfile.candidates[i].open_errno;
			envfile.candidates[i].fd = -1;
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

size_t env_file_entries(const struct env_entry **entries)
{
	*entries = envfile.entries;
	return envfile.n_entries;
}

bool env_file_present(spank_t sp, uint32_t job_id)
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

bool env_file_in_any_node_dir(uint32_t job_id)
{
	char path[PATH_MAX];
	struct stat st;
	struct dirent *de;
	DIR *dir;
	bool found = false;

	dir = opendir(antman_args_get()->state_dir);
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

/* The one node directory of state_dir holding JOBID.env; -1 (logged) when none or several do. */
static int only_node_with_file(uint32_t job_id, char *node, size_t len)
{
	char path[PATH_MAX];
	struct stat st;
	struct dirent *de;
	DIR *dir;
	int found = 0;

	dir = opendir(antman_args_get()->state_dir);
	if (!dir)
		return -1;
	while ((de = readdir(dir))) {
		if (!nodename_is_safe(de->d_name) || strlen(de->d_name) >= len)
			continue;
		if (env_file_path(path, sizeof(path), de->d_name, job_id) == 0 && lstat(path, &st) == 0) {
			if (found++)
				break;
			snprintf(node, len, "%s", de->d_name);
		}
	}
	closedir(dir);
	if (found > 1)
		slurm_error("antman: job %u has env files under several node directories of %s and the step does "
			    "not say which node it is", job_id, antman_args_get()->state_dir);
	return found == 1 ? 0 : -1;
}

int env_file_value(uint32_t job_id, const char *node, const char *key, char *buf, size_t len)
{
	char name[NODENAME_MAX], path[PATH_MAX];
	char *line = NULL;
	size_t cap = 0, key_len = 0, entries = 0;
	ssize_t n;
	struct stat st;
	int fd, rc = 0;
	FILE *f;

	if (node) {
		if (!nodename_is_safe(node) || strlen(node) >= sizeof(name))
			return -1;
		snprintf(name, sizeof(name), "%s", node);
	} else if (only_node_with_file(job_id, name, sizeof(name)) < 0) {
		return env_file_in_any_node_dir(job_id) ? -1 : 0;
	}
	if (env_file_path(path, sizeof(path), name, job_id) < 0)
		return -1;
	fd = open_env_file(path);
	if (fd < 0) {
		if (errno == ENOENT)
			return 0;
		slurm_error("antman: cannot open %s: %m", path);
		return -1;
	}
	if (fstat(fd, &st) < 0 || !file_is_trusted(path, &st) || !(f = fdopen(fd, "r"))) {
		close(fd);
		return -1;
	}
	/* The value the task env gets: the key's last entry among the first ENV_FILE_MAX_ENTRIES. */
	while (entries < ENV_FILE_MAX_ENTRIES && (n = getline(&line, &cap, f)) >= 0) {
		if (classify_line(line, n, &key_len) != ENV_LINE_ENTRY)
			continue;
		entries++;
		if (key_len != strlen(key) || strncmp(line, key, key_len) != 0)
			continue;
		rc = snprintf(buf, len, "%s", line + key_len + 1) >= (int)len ? -1 : 1;
	}
	if (rc < 0)
		slurm_error("antman: %s: %s is longer than %zu bytes", path, key, len - 1);
	free(line);
	fclose(f);
	return rc;
}

void release_env_files(void)
{
	close_candidates();
	free_entries();
}
