/*
 * slurm-antman SPANK plugin: the entry points Slurm calls, each dispatching on spank_context()
 * to the file for that context.
 *
 *   args.c        every context: plugstack.conf arguments; --antman=CLASS, --antman-elastic=MIN:MAX
 *                 and their validation
 *   submit.c      allocator and local (sbatch, salloc, srun): ANTMAN_CLASS and ANTMAN_ELASTIC into
 *                 the job control env
 *   slurmstepd.c  remote (slurmstepd): the job's env file applied to every task, ANTMAN_JOB_ID
 *   envfile.c     remote: finding, trusting and reading STATE_DIR/NODE/jobs/JOBID.env
 *   prolog.c      remote: running the Prolog hook when slurmd skipped it
 *   devices.c     remote: an opportunistic job's placed GPUs into its devices cgroup
 *
 * Only the symbols these entry points and SPANK_PLUGIN define are exported (antman_spank.map).
 */
#include "args.h"
#include "common.h"
#include "slurmstepd.h"
#include "submit.h"

SPANK_PLUGIN(antman, 1);

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	if (antman_args_parse(ac, av) < 0)
		return -1;

	switch (spank_context()) {
	case S_CTX_ALLOCATOR:
	case S_CTX_LOCAL:
		return antman_submit_init(sp);
	case S_CTX_REMOTE:
		return antman_stepd_init(sp);
	default:
		/* Only the contexts above parse user options; registering elsewhere is refused. */
		return 0;
	}
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	switch (spank_context()) {
	case S_CTX_ALLOCATOR:
	case S_CTX_LOCAL:
		return antman_submit_post_opt(sp);
	case S_CTX_REMOTE:
		return antman_stepd_post_opt(sp);
	default:
		return 0;
	}
}

int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return antman_stepd_task_init_privileged(sp);
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return antman_stepd_task_init(sp);
}

int slurm_spank_task_post_fork(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return antman_stepd_task_post_fork(sp);
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	/* Only slurmstepd opens files or reads entries; the other contexts have nothing to release. */
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return antman_stepd_exit();
}
