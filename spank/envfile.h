/*
 * The job's node-local env file, STATE_DIR/NODE/jobs/JOBID.env, written by the Prolog: found,
 * opened while slurmstepd is still root, checked for trust, read and kept for the task env.
 * Remote context (slurmstepd) only.
 */
#ifndef ANTMAN_ENVFILE_H
#define ANTMAN_ENVFILE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "common.h"

struct env_entry {
	char *key;
	char *value;
};

/* Besides root, the owner a file may have: slurmstepd's euid (the SlurmdUser), recorded before it drops to the user. */
ANTMAN_INTERNAL void env_file_trust_owner(uid_t stepd_euid);

/*
 * Whether the Prolog already wrote this job's env file here. Without SLURMD_NODENAME (absent
 * before tasks exist) any node directory counts: a real node has only its own, and only a
 * development host running several slurmd can hold another node's file for the same job.
 */
ANTMAN_INTERNAL bool env_file_present(spank_t sp, uint32_t job_id);

/* Any node directory: what the Prolog wrote, wherever the step's (user-set) environment says it runs. */
ANTMAN_INTERNAL bool env_file_in_any_node_dir(uint32_t job_id);

/* While privileged: opens the job's file under every node directory, for load_env_file to pick from. */
ANTMAN_INTERNAL void preopen_env_files(uint32_t job_id);

/* Reads the file for the task's node into the entries. A bad file is logged and never fails the step. */
ANTMAN_INTERNAL void load_env_file(spank_t sp, uint32_t job_id);

/* The entries load_env_file read, in file order; returns how many. */
ANTMAN_INTERNAL size_t env_file_entries(const struct env_entry **entries);

/*
 * One value of the job's env file, read while root (slurmstepd's own hooks, outside any task): under
 * node's directory, or, with node NULL, the one node directory that has a file for the job (a real
 * node; a development host running several slurmd and holding several is refused). Returns 1 and the
 * value in buf, 0 when the file or key is absent, -1 (logged) when the file cannot be trusted or read.
 */
ANTMAN_INTERNAL int env_file_value(uint32_t job_id, const char *node, const char *key, char *buf, size_t len);

/* Closes what preopen_env_files opened and frees the entries. */
ANTMAN_INTERNAL void release_env_files(void);

#endif /* ANTMAN_ENVFILE_H */
