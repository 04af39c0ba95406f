/*
 * The plugin's arguments: the plugstack.conf line (state_dir=, prolog=, opp_partition=, agent_path=) and the
 * --antman=CLASS and --antman-elastic=MIN:MAX options with their validation. The option callbacks run
 * in sbatch, salloc and srun before they contact slurmctld, so a bad value fails the command there; in
 * slurmstepd they run again with the value the submission carried.
 *
 * --antman-elastic is checked here only as a value (two numbers, 1 <= MIN <= MAX <= 64). The rules
 * that depend on the rest of the job (only with --antman=opportunistic or auto, MAX equal to the GPUs
 * per node on one node, or to the tasks times the GPUs per task of a job array across nodes) are
 * job_submit.lua's, which sees the whole request and never trusts the client.
 */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "args.h"

#define ANTMAN_DEFAULT_STATE_DIR "/var/lib/slurm-antman"
#define ANTMAN_ALLOWED_CLASSES "guaranteed, opportunistic, auto"
#define ANTMAN_ALLOWED_ELASTIC "MIN:MAX, two whole numbers (no sign, spaces or leading zero) with " \
	"1 <= MIN <= MAX <= 64, MAX being the GPUs per node the job asks for (--gres=gpu:MAX)"
#define ANTMAN_ALLOWED_ARGS "state_dir=PATH, prolog=PATH, opp_partition=NAME, agent_path=PATH"

static const char *const valid_classes[] = {"guaranteed", "opportunistic", "auto", NULL};

static struct antman_args args = {
	.state_dir = ANTMAN_DEFAULT_STATE_DIR,
};

static int antman_opt_class(int val, const char *optarg, int remote);
static int antman_opt_elastic(int val, const char *optarg, int remote);

static struct spank_option antman_options[] = {
	{
		"antman",
		"CLASS",
		"slurm-antman job class: guaranteed, opportunistic or auto",
		1,
		0,
		antman_opt_class,
	},
	{
		"antman-elastic",
		"MIN:MAX",
		"slurm-antman elastic width of an opportunistic job: it runs on MIN to MAX GPUs of one node "
		"(MAX as in --gres=gpu:MAX), or of a job array's nodes (MAX = tasks x GPUs per task); "
		"with --antman=opportunistic or auto",
		1,
		0,
		antman_opt_elastic,
	},
	SPANK_OPTIONS_TABLE_END,
};

const struct antman_args *antman_args_get(void)
{
	return &args;
}

/* Bad values end up in a terminal and in logs: keep control bytes out of both. */
static void printable_copy(char *dst, size_t dst_len, const char *src)
{
	size_t i = 0;

	for (; *src && i + 4 < dst_len; src++) {
		unsigned char c = (unsigned char)*src;
		if (isprint(c)) {
			dst[i++] = (char)c;
		} else {
			snprintf(dst + i, dst_len - i, "\\x%02x", c);
			i += 4;
		}
	}
	if (*src && i + 3 < dst_len) {
		memcpy(dst + i, "...", 3);
		i += 3;
	}
	dst[i] = '\0';
}

bool antman_class_is_valid(const char *value)
{
	for (size_t i = 0; valid_classes[i]; i++) {
		if (strcmp(value, valid_classes[i]) == 0)
			return true;
	}
	return false;
}

static int antman_opt_class(int val, const char *optarg, int remote)
{
	char shown[96];

	(void)val;
	(void)remote;
	if (!optarg || !antman_class_is_valid(optarg)) {
		printable_copy(shown, sizeof(shown), optarg ? optarg : "");
		slurm_error("--antman: invalid value '%s'; allowed values: %s",
			    shown, ANTMAN_ALLOWED_CLASSES);
		return ESPANK_BAD_ARG;
	}
	snprintf(args.job_class, sizeof(args.job_class), "%s", optarg);
	return ESPANK_SUCCESS;
}

/* One number of MIN:MAX: 1 or 2 decimal digits, no leading zero; the end of it in *end. */
static bool elastic_number(const char *s, const char **end, unsigned *out)
{
	unsigned v = 0;
	int digits = 0;

	if (*s < '1' || *s > '9')
		return false;
	for (; *s >= '0' && *s <= '9'; s++) {
		if (++digits > 2)
			return false;
		v = v * 10 + (unsigned)(*s - '0');
	}
	*end = s;
	*out = v;
	return true;
}

bool antman_elastic_parse(const char *value, unsigned *min, unsigned *max)
{
	const char *p = value;
	unsigned lo, hi;

	if (!value || !elastic_number(p, &p, &lo) || *p++ != ':' || !elastic_number(p, &p, &hi) || *p != '\0')
		return false;
	if (lo > hi || hi > ANTMAN_ELASTIC_MAX_GPUS)
		return false;
	*min = lo;
	*max = hi;
	return true;
}

static int antman_opt_elastic(int val, const char *optarg, int remote)
{
	char shown[96];
	unsigned lo, hi;

	(void)val;
	(void)remote;
	if (!antman_elastic_parse(optarg, &lo, &hi)) {
		printable_copy(shown, sizeof(shown), optarg ? optarg : "");
		slurm_error("--antman-elastic: invalid value '%s'; allowed: %s", shown, ANTMAN_ALLOWED_ELASTIC);
		return ESPANK_BAD_ARG;
	}
	snprintf(args.elastic, sizeof(args.elastic), "%u:%u", lo, hi);
	return ESPANK_SUCCESS;
}

/* Copies an absolute-path argument; "what" names it in the error. */
static int path_arg(char *dst, size_t len, const char *what, const char *path)
{
	if (path[0] != '/') {
		slurm_error("antman: plugstack.conf argument %s must be an absolute path, got '%s'", what, path);
		return -1;
	}
	if (strlen(path) >= len) {
		slurm_error("antman: plugstack.conf argument %s is too long (%zu bytes)", what, strlen(path));
		return -1;
	}
	snprintf(dst, len, "%s", path);
	return 0;
}

int antman_args_parse(int ac, char **av)
{
	for (int i = 0; i < ac; i++) {
		if (strncmp(av[i], "state_dir=", 10) == 0) {
			if (path_arg(args.state_dir, sizeof(args.state_dir), "state_dir", av[i] + 10) < 0)
				return -1;
		} else if (strncmp(av[i], "prolog=", 7) == 0) {
			if (path_arg(args.prolog, sizeof(args.prolog), "prolog", av[i] + 7) < 0)
				return -1;
		} else if (strncmp(av[i], "agent_path=", 11) == 0) {
			if (path_arg(args.agent_path, sizeof(args.agent_path), "agent_path", av[i] + 11) < 0)
				return -1;
		} else if (strncmp(av[i], "opp_partition=", 14) == 0) {
			const char *name = av[i] + 14;
			if (name[0] == '\0' || strlen(name) >= sizeof(args.opp_partition)) {
				slurm_error("antman: plugstack.conf argument opp_partition must be a partition name of 1 to %zu bytes, got '%s'",
					    sizeof(args.opp_partition) - 1, name);
				return -1;
			}
			snprintf(args.opp_partition, sizeof(args.opp_partition), "%s", name);
		} else {
			slurm_error("antman: unknown plugstack.conf argument '%s'; allowed: %s",
				    av[i], ANTMAN_ALLOWED_ARGS);
			return -1;
		}
	}
	return 0;
}

/* sbatch ignores a static spank_options[] table, so the options are registered here instead. */
int antman_args_register(spank_t sp)
{
	for (struct spank_option *opt = antman_options; opt->name; opt++) {
		spank_err_t rc = spank_option_register(sp, opt);
		if (rc != ESPANK_SUCCESS) {
			slurm_error("antman: cannot register option --%s: %s",
				    opt->name, spank_strerror(rc));
			return -1;
		}
	}
	return 0;
}
