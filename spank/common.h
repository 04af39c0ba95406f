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

/* The job env value of name, or "" when the step has none. */
static inline void job_getenv(spank_t sp, const char *name, char *buf, size_t len)
{
	if (spank_getenv(sp, name, buf, (int)len) != ESPANK_SUCCESS)
		buf[0] = '\0';
}

#endif /* ANTMAN_COMMON_H */
