#!/bin/bash

# Parameters
#SBATCH --account=proj42
#SBATCH --constraint='h100&ib'
#SBATCH --cpus-per-task=6
#SBATCH --error=/scratch/sub/%j/%j_0_log.err
#SBATCH --exclude='n[3-4,7]'
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=lm-350m
#SBATCH --mail-type=END
#SBATCH --mem=512GB
#SBATCH --no-kill
#SBATCH --nodes=5
#SBATCH --ntasks-per-node=2
#SBATCH --open-mode=append
#SBATCH --output=/scratch/sub/%j/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --qos=high
#SBATCH --requeue
#SBATCH --signal=B:USR2@300
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup
module load cuda/12.4

# command
export SUBMITIT_EXECUTOR=slurm
exec /usr/bin/python3 -u -m submitit.core._submit /scratch/sub/%j
