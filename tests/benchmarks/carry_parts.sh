# Sourced by the carry builders (user_stack_carry.sh, user_stack_fa4_carry.sh).
# carry_parts REPO NAME: moves the split parts p.NN of the current folder to REPO/.carry/NAME1,
# NAME2, ... (one part a folder, so a device call carries one) as NAME.part.NN; prints how many.
carry_parts() {
  local repo=$1 name=$2 n=0 p
  for p in p.*; do
    n=$((n + 1))
    mkdir -p "$repo/.carry/$name$n"
    mv "$p" "$repo/.carry/$name$n/$name.part.${p#p.}"
  done
  echo "$n"
}
