/*
 * Running the Prolog hook from slurmstepd (remote context only): when slurmd skipped it, and to
 * requeue a job whose placed GPU could not be allowed in its device cgroup.
 */
#ifndef ANTMAN_PROLOG_H
#define ANTMAN_PROLOG_H

#include <stdint.h>

#include "common.h"

/*
 * Runs prolog (an absolute path) for job_id and waits for it, at most PROLOG_TIMEOUT_S, with an
 * environment built from what slurmstepd knows; job_class is passed as SPANK_ANTMAN_CLASS. With
 * device_failure (the plugin's own text from antman_devices_grant, never the job's) it is passed as
 * ANTMAN_DEVICE_FAILURE, bytes outside [A-Za-z0-9 _:.,()/-] turned into '_': the hook then refuses
 * the job on this node and requeues it. Every failure is logged only.
 */
ANTMAN_INTERNAL void run_prolog_hook(spank_t sp, const char *prolog, uint32_t job_id, const char *job_class,
				     const char *device_failure);

#endif /* ANTMAN_PROLOG_H */
