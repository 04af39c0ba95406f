/*
 * An opportunistic job's GPUs in the devices cgroup (remote context, slurmstepd, as root).
 *
 * With ConstrainDevices=yes Slurm lets a job open only the device files of the GRES it holds. An
 * opportunistic job holds the count-only opportunistic GRES, which names no file, so Slurm denies it
 * every GPU; the Prolog recorded the GPU(s) the sidecar placed it on as ANTMAN_GPU_DEVICES in the
 * job's env file, and this allows exactly those in the job's cgroup tree (cgroup v1).
 */
#ifndef ANTMAN_DEVICES_H
#define ANTMAN_DEVICES_H

#include <stdint.h>
#include <sys/types.h>

#include "common.h"

/* The env file key that holds the devices to allow: "MAJOR:MINOR[,MAJOR:MINOR...]", char devices. */

/*
 * Allows the job's placed GPUs in the devices cgroup of the task whose pid is given, and in every
 * cgroup of the job above and beside it (job, steps, tasks). Returns 0 when done or when there is
 * nothing to do (no devices cgroup, no placed devices), -1 when a grant the job needs failed.
 */
ANTMAN_INTERNAL int antman_devices_grant(uint32_t job_id, uid_t uid, pid_t task_pid);

#endif /* ANTMAN_DEVICES_H */
