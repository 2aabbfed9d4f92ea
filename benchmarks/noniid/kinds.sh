# The kinds of non-IID data of docs/non-iid.md's evidence, as fedhet overrides on benchmarks/noniid/fmnist.toml;
# sourced by benchmarks/noniid/run.sh and benchmarks/tuning/run.sh.

settings() {  # the overrides of one kind of non-IID data (fmnist.toml: an IID split, no feature skew)
  case $1 in
    iid) ;;
    dir0.5) echo "-s partition.name=dirichlet -s partition.alpha=0.5" ;;
    dir0.1) echo "-s partition.name=dirichlet -s partition.alpha=0.1" ;;
    two_classes) echo "-s partition.name=k_classes -s partition.k=2" ;;
    noise) echo "-s features.name=noise -s features.sigma=0.1" ;;
    noise[0-9]*) echo "-s features.name=noise -s features.sigma=${1#noise}" ;;  # the noise sweep: noise0.5, noise1, ...
    rotated) echo "-s features.name=rotation -s features.domains=4" ;;
    quantity) echo "-s partition.name=quantity_lognormal -s partition.sigma=1.0" ;;
    *) echo "unknown kind $1; valid: iid dir0.5 dir0.1 two_classes noise rotated quantity, noise<sigma>" >&2; exit 2 ;;
  esac
}
