/*
 * An opportunistic job's GPUs in the devices cgroup (remote context, slurmstepd, as root).
 *
 * With ConstrainDevices=yes Slurm lets a job open only the device files of the GRES it holds. An
 * opportunistic job holds the count-only opportunistic GRES, which names no file, so Slurm denies it
 * every GPU; the Prolog recorded the GPU(s) the sidecar placed it on as ANTMAN_GPU_DEVICES in the
 * job's env file, and this allows exactly those: in the job's cgroup tree under cgroup v1
 * (devices.allow), in the task's own cgroup under cgroup v2 (its device program, cgroup_bpf.c).
 */
#ifndef ANTMAN_DEVICES_H
#define ANTMAN_DEVICES_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common.h"

/*
 * Allows the job's placed GPUs (ANTMAN_GPU_DEVICES of its env file) to the task whose pid is given:
 * cgroup v1, in the task's devices cgroup and every cgroup of the job above and beside it (job,
 * steps, tasks); cgroup v2, in the device program of the task's own cgroup. Returns 0 when done or
 * when there is nothing to do (no device control, no placed devices), -1 when a grant the job needs
 * failed: failure then holds why ("cannot allow its GPU 195:1 on this cgroup v2 node: ..."), the
 * plugin's own text for the caller's one log line and for ANTMAN_DEVICE_FAILURE; nothing logged here.
 */
ANTMAN_INTERNAL int antman_devices_grant(uint32_t job_id, uid_t uid, pid_t task_pid, char *failure, size_t failure_len);

/*
 * Whether the job's env file on the task's node now says ANTMAN_REFUSED (the Prolog hook, run after a grant
 * failed, wrote it and asked Slurm to requeue the job): the task's own task_init then refuses to start it.
 */
ANTMAN_INTERNAL int antman_devices_refused(uint32_t job_id, uid_t uid, pid_t task_pid);

#endif /* ANTMAN_DEVICES_H */
