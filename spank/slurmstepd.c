/*
 * Remote context (slurmstepd): applies the node-local env file STATE_DIR/NODE/jobs/JOBID.env,
 * written by the Prolog, to every task (envfile.c), and exports ANTMAN_JOB_ID. When a
 * slurm-antman job's file is missing, it first runs the Prolog hook itself, once per step
 * (prolog.c). A job the Prolog refused, or an opportunistic one whose file no Prolog could write,
 * does not start its tasks here (fail closed).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "args.h"
#include "devices.h"
#include "envfile.h"
#include "prolog.h"
#include "slurmstepd.h"

static struct {
	bool no_env_file;         /* an opportunistic job whose env file no Prolog could write here */
	bool device_failure_sent; /* the Prolog hook was asked to requeue the job (once per step, not per task) */
} stepd;

static int job_id_of(spank_t sp, uint32_t *job_id)
{
	spank_err_t rc = spank_get_item(sp, S_JOB_ID, job_id);

	if (rc != ESPANK_SUCCESS) {
		slurm_error("antman: cannot get the job id: %s", spank_strerror(rc));
		return -1;
	}
	return 0;
}

/* The class the user asked for: the remote --antman callback, else the job control env. */
static void requested_class(spank_t sp, char *buf, size_t len)
{
	const struct antman_args *args = antman_args_get();

	if (args->job_class[0]) {
		snprintf(buf, len, "%s", args->job_class);
		return;
	}
	job_getenv(sp, ANTMAN_ENV_JOB_SPANK_CLASS, buf, len);
	if (buf[0] && !antman_class_is_valid(buf))
		buf[0] = '\0';
}

int antman_stepd_init(spank_t sp)
{
	/* slurmstepd is still itself here; it drops to the user before the tasks. */
	env_file_trust_owner(geteuid());
	return antman_args_register(sp);
}

/*
 * Once per step, as root, before any task exists: if this slurm-antman job has no env file here,
 * slurmd skipped the Prolog (a requeued job restarting on a node that still caches its
 * credential), so run it now; task_init_privileged then finds the file it wrote.
 */
int antman_stepd_post_opt(spank_t sp)
{
	const struct antman_args *args = antman_args_get();
	uint32_t job_id;
	char job_class[ANTMAN_CLASS_MAX];
	char partition[ANTMAN_PARTITION_MAX];

	if (args->prolog[0] == '\0' || job_id_of(sp, &job_id) < 0)
		return 0;
	requested_class(sp, job_class, sizeof(job_class));
	job_getenv(sp, "SLURM_JOB_PARTITION", partition, sizeof(partition));
	if (job_class[0] == '\0' && !(args->opp_partition[0] && strcmp(partition, args->opp_partition) == 0))
		return 0;
	if (env_file_present(sp, job_id))
		return 0;
	run_prolog_hook(sp, args->prolog, job_id, job_class, NULL);
	/*
	 * Still no file (the state directory full or unwritable, the hook broken): the Prolog could not
	 * even record a refusal. An opportunistic job must not run unmanaged beside a guaranteed one, so
	 * its tasks fail; the Prolog has asked Slurm to requeue it. A guaranteed job runs on the GPUs
	 * Slurm bound, as it would without slurm-antman.
	 */
	if (!env_file_in_any_node_dir(job_id) &&
	    (strcmp(job_class, "opportunistic") == 0 ||
	     (args->opp_partition[0] && strcmp(partition, args->opp_partition) == 0)))
		stepd.no_env_file = true;
	return 0;
}

int antman_stepd_task_init_privileged(spank_t sp)
{
	uint32_t job_id;

	if (job_id_of(sp, &job_id) == 0)
		preopen_env_files(job_id);
	return 0;
}

/*
 * A managed job's own Python (a venv with torch only, a conda environment) has never heard of
 * slurm-antman: the site's agent bundle goes first on its PYTHONPATH, where the bundle's
 * sitecustomize loads the agent (and then the sitecustomize it shadows). First, because
 * Python imports the first sitecustomize on sys.path. The path is the admin's (plugstack.conf),
 * never the job's; a job that wants no agent sets ANTMAN_AGENT_DISABLE=1.
 */
static void add_agent_path(spank_t sp, uint32_t job_id)
{
	const char *agent = antman_args_get()->agent_path;
	/* static: task_init runs in the task's own process, once; PYTHONPATH may be long */
	static char old[65536], value[sizeof(old) + PATH_MAX + 1];
	spank_err_t rc;

	if (agent[0] == '\0')
		return;
	rc = spank_getenv(sp, "PYTHONPATH", old, (int)sizeof(old));
	if (rc == ESPANK_ENV_NOEXIST || (rc == ESPANK_SUCCESS && old[0] == '\0')) {
		snprintf(value, sizeof(value), "%s", agent);
	} else if (rc == ESPANK_SUCCESS) {
		snprintf(value, sizeof(value), "%s:%s", agent, old);
	} else {
		/* the job's own PYTHONPATH is never cut short for the agent's sake */
		slurm_error("antman: job %u: PYTHONPATH unreadable (%s); the agent bundle is not added",
			    job_id, spank_strerror(rc));
		return;
	}
	if (spank_setenv(sp, "PYTHONPATH", value, 1) != ESPANK_SUCCESS)
		slurm_error("antman: job %u: cannot put the agent on PYTHONPATH", job_id);
}

int antman_stepd_task_init(spank_t sp)
{
	const struct env_entry *entries;
	size_t n_entries;
	uint32_t job_id;
	char buf[16];

	if (job_id_of(sp, &job_id) < 0)
		return 0;

	if (stepd.no_env_file) {
		slurm_error("antman: job %u not started on this node: it is opportunistic and the node could not "
			    "write its env file (state directory %s full or unwritable?)", job_id,
			    antman_args_get()->state_dir);
		return -1;
	}
	load_env_file(sp, job_id);
	n_entries = env_file_entries(&entries);
	/*
	 * The Prolog found no GPU this opportunistic job may use under the rules (or no sidecar to ask)
	 * and asked Slurm to requeue it: the task must not start unmanaged in the meantime (fail closed).
	 */
	for (size_t i = 0; i < n_entries; i++) {
		if (strcmp(entries[i].key, ANTMAN_ENV_REFUSED) == 0) {
			slurm_error("antman: job %u not started on this node: %s", job_id, entries[i].value);
			return -1;
		}
	}
	snprintf(buf, sizeof(buf), "%u", job_id);
	if (spank_setenv(sp, ANTMAN_ENV_JOB_ID, buf, 1) != ESPANK_SUCCESS)
		slurm_error("antman: cannot set " ANTMAN_ENV_JOB_ID " in the task env");
	for (size_t i = 0; i < n_entries; i++) {
		spank_err_t rc = spank_setenv(sp, entries[i].key, entries[i].value, 1);
		if (rc != ESPANK_SUCCESS)
			slurm_error("antman: cannot set %s in the task env: %s",
				    entries[i].key, spank_strerror(rc));
	}
	if (n_entries > 0)
		add_agent_path(sp, job_id);
	return 0;
}

/*
 * As root in slurmstepd, once per task, after Slurm has set up the step's cgroups: an opportunistic
 * job may open the GPU(s) its sidecar placed it on, which Slurm's ConstrainDevices denied it (it
 * holds no GPU GRES). A grant that fails fails the task: the job would otherwise start on a GPU it
 * cannot open, and crash later with a less telling error. It also runs the Prolog hook with
 * ANTMAN_DEVICE_FAILURE, once per step, which refuses the job on this node and requeues it.
 */
int antman_stepd_task_post_fork(spank_t sp)
{
	const char *prolog = antman_args_get()->prolog;
	char failure[1024], job_class[ANTMAN_CLASS_MAX];
	uint32_t job_id, uid;
	pid_t pid;

	if (job_id_of(sp, &job_id) < 0)
		return 0;
	if (spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_TASK_PID, &pid) != ESPANK_SUCCESS) {
		slurm_error("antman: job %u: cannot get the task's uid or pid; its GPUs are not allowed", job_id);
		return -1;
	}
	if (antman_devices_grant(job_id, (uid_t)uid, pid, failure, sizeof(failure)) == 0)
		return 0;
	slurm_error("antman: job %u: %s; %s", job_id, failure,
		    prolog[0] ? "the job is requeued" : "its tasks fail (no prolog= in plugstack.conf to requeue it)");
	if (prolog[0] && !stepd.device_failure_sent) {
		stepd.device_failure_sent = true;
		requested_class(sp, job_class, sizeof(job_class));
		run_prolog_hook(sp, prolog, job_id, job_class, failure);
	}
	/*
	 * The hook refused the job in its env file and asked Slurm to requeue it: the task's own task_init now
	 * declines to start it, before it runs anything of the user's, as for every refusal (unless the requeue
	 * ends the task first). Failing here instead would be a failed launch,
	 * which Slurm answers by draining the whole node ("Slurmd could not execve job", drain_nodes; seen with
	 * 26.05), guaranteed jobs and all. Only when the refusal could not be recorded does the launch fail.
	 */
	if (antman_devices_refused(job_id, (uid_t)uid, pid))
		return 0;
	if (prolog[0])
		slurm_error("antman: job %u: its refusal could not be recorded in its env file: the launch fails", job_id);
	return -1;
}

int antman_stepd_exit(void)
{
	release_env_files();
	return 0;
}
