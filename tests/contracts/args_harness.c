/*
 * Runs spank/args.c's --antman-elastic callback outside sbatch, for tests/test_contracts.py and
 * tests/test_spank_elastic.py. The file is included, not linked, so its static callback is the code
 * under test; the Slurm calls it makes are stood in for below.
 *
 *   harness elastic HEX(VALUE)   "ok MIN:MAX" (what the plugin passes on as ANTMAN_ELASTIC) or
 *                                "refused", with the plugin's error message on stderr
 *
 * The value comes as hex ("-" for the empty string) so that any byte, control bytes included, can be
 * given as a command-line argument.
 */
#include <stdarg.h>
#include <stdlib.h>

#include "args.c"

void slurm_error(const char *format, ...)
{
	va_list ap;

	va_start(ap, format);
	vfprintf(stderr, format, ap);
	va_end(ap);
	fputc('\n', stderr);
}

spank_err_t spank_option_register(spank_t sp, struct spank_option *opt)
{
	(void)sp;
	(void)opt;
	return ESPANK_SUCCESS;
}

const char *spank_strerror(spank_err_t err)
{
	(void)err;
	return "stub";
}

static int unhex(const char *hex, char *out, size_t len)
{
	size_t n = strlen(hex);

	if (strcmp(hex, "-") == 0) {
		out[0] = '\0';
		return 0;
	}
	if (n % 2 || n / 2 >= len)
		return -1;
	for (size_t i = 0; i < n / 2; i++) {
		char byte[3] = {hex[2 * i], hex[2 * i + 1], '\0'};
		out[i] = (char)strtoul(byte, NULL, 16);
	}
	out[n / 2] = '\0';
	return 0;
}

int main(int argc, char **argv)
{
	char value[512];

	if (argc == 3 && strcmp(argv[1], "elastic") == 0) {
		if (unhex(argv[2], value, sizeof(value)) < 0)
			return 2;
		if (antman_opt_elastic(0, value, 0) != ESPANK_SUCCESS) {
			puts("refused");
			return 0;
		}
		printf("ok %s\n", antman_args_get()->elastic);
		return 0;
	}
	fprintf(stderr, "usage: see the comment at the top of %s\n", __FILE__);
	return 2;
}
