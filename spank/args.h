/*
 * The plugin's arguments: plugstack.conf's (every context) and the user's --antman=CLASS and
 * --antman-elastic=MIN:MAX (the contexts that parse user options: allocator, local and remote).
 */
#ifndef ANTMAN_ARGS_H
#define ANTMAN_ARGS_H

#include <limits.h>
#include <stdbool.h>

#include "common.h"

#define ANTMAN_CLASS_MAX 32      /* a --antman value, with its NUL */
#define ANTMAN_PARTITION_MAX 128 /* a partition name, with its NUL */
#define ANTMAN_ELASTIC_MAX 8      /* a canonical MIN:MAX ("64:64"), with its NUL */
#define ANTMAN_ELASTIC_MAX_GPUS 64 /* MAX's bound: job_register's gpus (docs/protocol.md) */

struct antman_args {
	char state_dir[PATH_MAX];
	char prolog[PATH_MAX];                    /* hook to run when the env file is missing, "" = never */
	char opp_partition[ANTMAN_PARTITION_MAX]; /* a job in this partition is a slurm-antman job */
	char agent_path[PATH_MAX];                /* the agent bundle put on a managed job's PYTHONPATH, "" = none */
	char job_class[ANTMAN_CLASS_MAX];         /* validated --antman value, "" when not given */
	char elastic[ANTMAN_ELASTIC_MAX];         /* validated --antman-elastic value, "" when not given */
};

/* The arguments as parsed so far; state_dir has its default until plugstack.conf names one. */
ANTMAN_INTERNAL const struct antman_args *antman_args_get(void);

/* plugstack.conf's arguments. Logs what is wrong and returns -1 on anything not allowed. */
ANTMAN_INTERNAL int antman_args_parse(int ac, char **av);

/* Registers --antman and --antman-elastic; only valid from slurm_spank_init in the contexts that parse user options. */
ANTMAN_INTERNAL int antman_args_register(spank_t sp);

/* Whether value is one of the job classes, exactly and lowercase. */
ANTMAN_INTERNAL bool antman_class_is_valid(const char *value);

/*
 * Whether value is an elastic range MIN:MAX: two decimal numbers of 1 or 2 digits without a leading
 * zero, 1 <= MIN <= MAX <= ANTMAN_ELASTIC_MAX_GPUS, nothing else. On success *min and *max hold them.
 */
ANTMAN_INTERNAL bool antman_elastic_parse(const char *value, unsigned *min, unsigned *max);

#endif /* ANTMAN_ARGS_H */
