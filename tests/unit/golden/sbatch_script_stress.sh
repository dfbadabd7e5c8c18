#!/bin/bash
#SBATCH --job-name='it'"'"'s a "test"; job'
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=60
#SBATCH --no-kill
#SBATCH --requeue
#SBATCH --signal=B:USR2@120
#SBATCH --output='/scratch/my runs/it'"'"'s "q"; rm -rf x/coordinator-%j.out'
#SBATCH --open-mode=append

# setup
export DATA_DIR="/data/my dir"; echo 'ready; go'
cd '/work/it'"'"'s here' && ls

exec python -m ckptless_hpc 'run.dir=/scratch/my runs/it'"'"'s; x'
