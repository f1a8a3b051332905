# The base a script works on, shared by the shell entry points (sourced, not run).
# The caller sets root (the repository or image source root). Then:
#   resolve_base NAME   sets base (NAME, else $KVSTACK_BASE, else vllm/default) and checks it exists
#   pin COMPONENT KEY   a value of $root/COMPONENT/$base.env (vllm/<base>.env, lmcache/<base>.env)
#   pin_file COMPONENT  that file's path
resolve_base() {
  base="${1:-${KVSTACK_BASE:-$(cat "$root/vllm/default")}}"
  if [ ! -f "$root/vllm/$base.env" ]; then
    echo "error: unknown base '$base' (the bases are: $(cd "$root/vllm" && ls -- *.env | sed 's/\.env$//' | tr '\n' ' '))" >&2
    exit 2
  fi
}
pin_file() { echo "$root/$1/$base.env"; }
pin() { sed -n "s/^$2=//p" "$(pin_file "$1")"; }
