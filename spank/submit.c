/*
 * Allocator and local contexts (sbatch, salloc, srun): takes --antman=CLASS and puts ANTMAN_CLASS
 * into the job control environment, where job_submit.lua (job_desc.spank_job_env), the
 * Prolog/Epilog (SPANK_ANTMAN_CLASS) and the batch script (SLURM_SPANK_ANTMAN_CLASS) find it.
 */
#include "args.h"
#include "submit.h"

int antman_submit_init(spank_t sp)
{
	return antman_args_register(sp);
}

int antman_submit_post_opt(spank_t sp)
{
	const struct antman_args *args = antman_args_get();
	spank_err_t rc;

	if (args->job_class[0] == '\0')
		return 0;
	rc = spank_job_control_setenv(sp, ANTMAN_ENV_CLASS, args->job_class, 1);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("antman: cannot pass --antman=%s to the job: %s",
			    args->job_class, spank_strerror(rc));
		return -1;
	}
	return 0;
}
