# The base a script works on, shared by the shell entry points (sourced, not run).
# The caller sets root (the repository or image source root). Then:
#   resolve_base NAME   sets base (NAME, else $KVSTACK_BASE, else bases/default) and checks it exists
#   pin COMPONENT KEY   a value of bases/$base/COMPONENT.env
#   pin_file COMPONENT  that file's path
resolve_base() {
  base="${1:-${KVSTACK_BASE:-$(cat "$root/bases/default")}}"
  if [ ! -f "$root/bases/$base/vllm.env" ]; then
    echo "error: unknown base '$base' (the bases are: $(cd "$root/bases" && ls -d */ | tr -d / | tr '\n' ' '))" >&2
    exit 2
  fi
}
pin_file() { echo "$root/bases/$base/$1.env"; }
pin() { sed -n "s/^$2=//p" "$(pin_file "$1")"; }
