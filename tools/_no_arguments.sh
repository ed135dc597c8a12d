# Sourced first by the tools that take no argument (demo.sh, setup.sh, fetch_gpu_wheels.sh):
#   source "$(dirname "$0")/_no_arguments.sh" "$0" "$@"
# -h/--help prints the calling script's header comment and exits 0; any other argument is one
# line and exit 1 (the one code of every user error): a typo must never start the work (the
# demo deletes demo/run, this downloads).
lmscale_script=$1
shift
case "${1:-}" in
  -h|--help) awk 'NR == 1 { next } /^#( |$)/ { sub(/^# ?/, ""); print; next } { exit }' \
               "$lmscale_script"; exit 0 ;;
  "") ;;
  *) echo "error: unknown argument '$1': $lmscale_script takes none (see --help)" >&2
     exit 1 ;;
esac
