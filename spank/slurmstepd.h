/* Remote context: slurmstepd on the compute node, which runs the job step's tasks. */
#ifndef ANTMAN_SLURMSTEPD_H
#define ANTMAN_SLURMSTEPD_H

#include "common.h"

ANTMAN_INTERNAL int antman_stepd_init(spank_t sp);
ANTMAN_INTERNAL int antman_stepd_post_opt(spank_t sp);
ANTMAN_INTERNAL int antman_stepd_task_init_privileged(spank_t sp);
ANTMAN_INTERNAL int antman_stepd_task_init(spank_t sp);
ANTMAN_INTERNAL int antman_stepd_task_post_fork(spank_t sp);
ANTMAN_INTERNAL int antman_stepd_exit(void);

#endif /* ANTMAN_SLURMSTEPD_H */
