// The translation unit that carries kiln's precompiled header (cmake/KilnPch.cmake); it has no code.
