/* Allocator and local contexts: sbatch, salloc and srun on the submitting host. */
#ifndef ANTMAN_SUBMIT_H
#define ANTMAN_SUBMIT_H

#include "common.h"

ANTMAN_INTERNAL int antman_submit_init(spank_t sp);
ANTMAN_INTERNAL int antman_submit_post_opt(spank_t sp);

#endif /* ANTMAN_SUBMIT_H */
