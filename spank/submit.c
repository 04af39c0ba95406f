/*
 * Allocator and local contexts (sbatch, salloc, srun): takes --antman=CLASS and --antman-elastic=MIN:MAX
 * and puts ANTMAN_CLASS and ANTMAN_ELASTIC into the job control environment, where job_submit.lua
 * (job_desc.spank_job_env), the Prolog/Epilog (SPANK_ANTMAN_CLASS, SPANK_ANTMAN_ELASTIC) and the batch
 * script (SLURM_SPANK_ANTMAN_CLASS, SLURM_SPANK_ANTMAN_ELASTIC) find them.
 */
#include "args.h"
#include "submit.h"

int antman_submit_init(spank_t sp)
{
	return antman_args_register(sp);
}

/* name=value into the job control env, unless value is "" (the option was not given). */
static int pass_on(spank_t sp, const char *option, const char *name, const char *value)
{
	spank_err_t rc;

	if (value[0] == '\0')
		return 0;
	rc = spank_job_control_setenv(sp, name, value, 1);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("antman: cannot pass --%s=%s to the job: %s", option, value, spank_strerror(rc));
		return -1;
	}
	return 0;
}

int antman_submit_post_opt(spank_t sp)
{
	const struct antman_args *args = antman_args_get();

	if (pass_on(sp, "antman", ANTMAN_ENV_CLASS, args->job_class) < 0)
		return -1;
	/* Its rules against the class and the GPUs are job_submit.lua's (args.c says why). */
	return pass_on(sp, "antman-elastic", ANTMAN_ENV_ELASTIC, args->elastic);
}
