"""pi0.5 (LeRobot 0.6.1's `PI05Policy`): what pisft knows of LeRobot's pi0.5 internals."""
