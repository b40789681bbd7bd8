#pragma once
// The kiln runner's subcommands. Each takes the arguments after its name and returns an exit code;
// errors are thrown and turned into exit codes only in main.
#include <memory>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/engine/plugin.hpp"

namespace kiln::app {

using Args = std::vector<std::string>;

int cmd_run(const Args& args);
int cmd_config(const Args& args);
int cmd_modules(const Args& args);
int cmd_tokenize(const Args& args);
int cmd_topology(const Args& args);
int cmd_plot(const Args& args);
int cmd_export(const Args& args);
int cmd_generate(const Args& args);
int cmd_eval(const Args& args);

// Parses a subcommand's arguments (positional arguments as `positional`, -1 = any number); returns
// false after printing the help when --help (-h) was given.
bool parse_args(const Args& args, const boost::program_options::options_description& opts,
                const boost::program_options::positional_options_description& positional);

// A pipeline file resolved against kiln's modules and the plugins it names.
struct LoadedPipeline {
  ModuleRegistry registry;
  std::unique_ptr<PluginLoader> plugins;
  config::PipelineConfig config;
};
std::unique_ptr<LoadedPipeline> load_pipeline(const std::string& file, const std::vector<std::string>& sets);

}  // namespace kiln::app
