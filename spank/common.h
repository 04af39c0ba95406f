/*
 * What every file of the slurm-antman SPANK plugin shares.
 *
 * The plugin is one shared object built from several files, so the helpers one file calls in
 * another need external linkage. ANTMAN_INTERNAL gives them hidden visibility: they bind within
 * the plugin and never enter its dynamic symbol table. The version script antman_spank.map says
 * the same for the whole object (only plugin_name, plugin_type, plugin_version, spank_plugin_* and
 * slurm_spank_* are exported), so no helper can collide with a symbol of slurmstepd, sbatch or
 * another plugin.
 */
#ifndef ANTMAN_COMMON_H
#define ANTMAN_COMMON_H

#include <stddef.h>

#include <slurm/spank.h>

#define ANTMAN_INTERNAL __attribute__((visibility("hidden")))

/*
 * The environment variables the plugin shares with the Prolog, the Lua scripts and the agent: one
 * name each, as docs/protocol.md ("Environment variables") lists them; tests/test_contracts.py
 * compares these with docs/contracts.json.
 */
#define ANTMAN_ENV_CLASS "ANTMAN_CLASS"
#define ANTMAN_ENV_SPANK_CLASS "SPANK_ANTMAN_CLASS"
#define ANTMAN_ENV_JOB_SPANK_CLASS "SLURM_SPANK_ANTMAN_CLASS"
#define ANTMAN_ENV_ELASTIC "ANTMAN_ELASTIC"
#define ANTMAN_ENV_JOB_ID "ANTMAN_JOB_ID"
#define ANTMAN_ENV_GPU_DEVICES "ANTMAN_GPU_DEVICES"
#define ANTMAN_ENV_REFUSED "ANTMAN_REFUSED"
#define ANTMAN_ENV_JOB_NODEID "ANTMAN_JOB_NODEID"
#define ANTMAN_ENV_PROLOG_FROM_SPANK "ANTMAN_PROLOG_FROM_SPANK"
#define ANTMAN_ENV_DEVICE_FAILURE "ANTMAN_DEVICE_FAILURE"

/* The job env value of name, or "" when the step has none. */
static inline void job_getenv(spank_t sp, const char *name, char *buf, size_t len)
{
	if (spank_getenv(sp, name, buf, (int)len) != ESPANK_SUCCESS)
		buf[0] = '\0';
}

#endif /* ANTMAN_COMMON_H */
