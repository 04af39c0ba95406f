/* Running the Prolog hook from slurmstepd when slurmd skipped it (remote context only). */
#ifndef ANTMAN_PROLOG_H
#define ANTMAN_PROLOG_H

#include <stdint.h>

#include "common.h"

/*
 * Runs prolog (an absolute path) for job_id and waits for it, at most PROLOG_TIMEOUT_S, with an
 * environment built from what slurmstepd knows; job_class is passed as SPANK_ANTMAN_CLASS.
 * Every failure is logged only.
 */
ANTMAN_INTERNAL void run_prolog_hook(spank_t sp, const char *prolog, uint32_t job_id, const char *job_class);

#endif /* ANTMAN_PROLOG_H */
