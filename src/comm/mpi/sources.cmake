# The MPI backend's sources, relative to src/comm/mpi: compiled against Open
# MPI for kdacp_mpi (CMakeLists.txt here) and against SimGrid's SMPI for
# kdacp_smpi (../smpi/CMakeLists.txt).
set(KDACP_MPI_SOURCES session.cpp environment.cpp launch.cpp communicator.cpp collectives.cpp datatype.cpp
    header.cpp point_to_point.cpp wait.cpp)
