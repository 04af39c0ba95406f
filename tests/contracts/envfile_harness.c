/*
 * Runs spank/envfile.c's own reader outside slurmstepd, for tests/test_contracts.py. The file is
 * included, not linked, so its static parser is the code under test; the few Slurm calls it makes
 * are stood in for below.
 *
 *   harness read FILE                   one line per entry applied: HEX(KEY) HEX(VALUE); or "refused"
 *   harness value STATE_DIR NODE JOB KEY "1 HEX(VALUE)", "0" or "-1" (env_file_value)
 *   harness path STATE_DIR NODE JOB      the path the plugin reads
 *   harness node NAME                    1 when the plugin accepts NAME as a node directory, else 0
 */
#include <stdarg.h>

#include "envfile.c"

static struct antman_args harness_args;

const struct antman_args *antman_args_get(void)
{
	return &harness_args;
}

spank_err_t spank_getenv(spank_t sp, const char *var, char *buf, int len)
{
	(void)sp;
	(void)var;
	(void)buf;
	(void)len;
	return ESPANK_ENV_NOEXIST;
}

void slurm_error(const char *format, ...)
{
	va_list ap;

	va_start(ap, format);
	vfprintf(stderr, format, ap);
	va_end(ap);
	fputc('\n', stderr);
}

void slurm_debug(const char *format, ...)
{
	(void)format;
}

static void put_hex(const char *s)
{
	if (!*s)
		fputc('-', stdout); /* an empty field must still be a field */
	for (; *s; s++)
		printf("%02x", (unsigned char)*s);
}

static void set_state_dir(const char *dir)
{
	snprintf(harness_args.state_dir, sizeof(harness_args.state_dir), "%s", dir);
}

int main(int argc, char **argv)
{
	env_file_trust_owner(geteuid());
	if (argc == 3 && strcmp(argv[1], "read") == 0) {
		const struct env_entry *entries;
		struct stat st;
		int fd = open_env_file(argv[2]);

		if (fd < 0 || fstat(fd, &st) < 0)
			return 2;
		if (!file_is_trusted(argv[2], &st)) {
			puts("refused");
			close(fd);
			return 0;
		}
		read_env_fd(fd, argv[2]);
		size_t n = env_file_entries(&entries);
		for (size_t i = 0; i < n; i++) {
			put_hex(entries[i].key);
			fputc(' ', stdout);
			put_hex(entries[i].value);
			fputc('\n', stdout);
		}
		release_env_files();
		return 0;
	}
	if (argc == 6 && strcmp(argv[1], "value") == 0) {
		char buf[ENV_FILE_MAX_BYTES + 1];
		int rc;

		set_state_dir(argv[2]);
		rc = env_file_value((uint32_t)strtoul(argv[4], NULL, 10), argv[3], argv[5], buf, sizeof(buf));
		printf("%d", rc);
		if (rc == 1) {
			fputc(' ', stdout);
			put_hex(buf);
		}
		fputc('\n', stdout);
		return 0;
	}
	if (argc == 5 && strcmp(argv[1], "path") == 0) {
		char path[PATH_MAX];

		set_state_dir(argv[2]);
		if (env_file_path(path, sizeof(path), argv[3], (uint32_t)strtoul(argv[4], NULL, 10)) < 0)
			return 2;
		puts(path);
		return 0;
	}
	if (argc == 3 && strcmp(argv[1], "node") == 0) {
		printf("%d\n", nodename_is_safe(argv[2]) ? 1 : 0);
		return 0;
	}
	fprintf(stderr, "usage: see the comment at the top of %s\n", __FILE__);
	return 2;
}
