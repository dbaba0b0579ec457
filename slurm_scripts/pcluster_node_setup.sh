#!/usr/bin/env bash
# ParallelCluster custom action (OnNodeConfigured) for pcluster.yaml: makes every node able to
# run the series, from a venv on /fsx or from the Dockerfile's image. Runs as root on each node
# as it boots; its output is in /var/log/cloud-init-output.log there.
#
#   aws s3 cp slurm_scripts/pcluster_node_setup.sh s3://YOUR-BUCKET/   # before create-cluster
#
# Argument: head or compute (pcluster.yaml passes it).
set -euo pipefail
role="${1:?usage: pcluster_node_setup.sh head|compute}"

# Python 3.11 on every node, so that a venv made on /fsx from the head node runs on the compute
# nodes too, with the same interpreter path. From the deadsnakes PPA, as in the Dockerfile:
# Ubuntu 22.04's own python3.11 is an early 3.11.0 build that torch's compiler may not run on.
export DEBIAN_FRONTEND=noninteractive
add-apt-repository -y ppa:deadsnakes/ppa   # also refreshes the package lists
apt-get install -y -q --no-install-recommends python3.11 python3.11-venv

# Containers under Slurm (srun --container-image): the official AMI (ParallelCluster >= 3.11.1)
# ships enroot and pyxis with example configs but leaves them off. enroot needs a persistent
# and a per-boot directory that every user can write to (1777, like /tmp).
mkdir -p /var/enroot /run/enroot /run/pyxis
chmod 1777 /var/enroot /run/enroot /run/pyxis
examples=/opt/parallelcluster/examples
install -m 0644 "$examples/enroot/enroot.conf" /etc/enroot/enroot.conf

# The pyxis plugin is loaded by slurmctld's and slurmd's plugstack, which lives in the shared
# /opt/slurm/etc: the head node writes it once, then tells the daemons to read it again.
if [ "$role" = head ]; then
  mkdir -p /opt/slurm/etc/plugstack.conf.d
  install -m 0644 "$examples/spank/plugstack.conf" /opt/slurm/etc/plugstack.conf
  install -m 0644 "$examples/pyxis/pyxis.conf" /opt/slurm/etc/plugstack.conf.d/pyxis.conf
  /opt/slurm/bin/scontrol reconfigure
fi
